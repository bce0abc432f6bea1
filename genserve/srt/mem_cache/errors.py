"""Errors raised by KV memory pools and prefix caches."""


class IntegrityError(RuntimeError):
    """A pool or cache invariant is broken (leak, double free, negative lock count...).

    Always a bug in the caller or in the cache, never a user error.
    """
