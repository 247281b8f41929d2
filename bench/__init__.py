"""Benchmarks: `make bench` (docs/benchmarks.md). They measure; they are never timed tests."""
