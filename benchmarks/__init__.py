"""Benchmarks of robez: not installed, and never imported by ``robez_core`` or ``service``.

``benchmarks/README.md`` maps each command to the report it writes under ``docs/``.
"""
