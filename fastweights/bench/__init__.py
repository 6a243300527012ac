"""Benchmarks: scripts that time and write tables (never timed tests)."""
