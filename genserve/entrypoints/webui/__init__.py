"""The browser client: `/` and its static files, served whenever the gateway runs."""
