"""Benchmarks runnable as `genserve bench ...` (no torch: they talk HTTP)."""
