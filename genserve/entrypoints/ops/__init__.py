"""Health, model listing and Prometheus metrics."""
