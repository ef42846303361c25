"""Benchmarks and the regression gate behind ``segflow bench`` (see docs/benchmarking.md)."""
