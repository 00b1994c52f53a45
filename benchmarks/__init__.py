"""Benchmark scripts (speed/, quality/, memory/, gpu/), their shared helpers (common.py) and results (results/)."""
