"""Benchmarks of the service's parts: the write-ahead log, restarts, request bodies, update checks."""
