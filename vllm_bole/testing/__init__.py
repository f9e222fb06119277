"""Test utilities shared by tests and benchmarks: float64 oracles, tiny model fixtures."""
