"""Benchmarks of the core: the fused kernels, tables and compression (``robez_core``)."""
