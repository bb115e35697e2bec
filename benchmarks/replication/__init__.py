"""Benchmarks of replicated mode (JetStream)."""
