"""Datasets, metrics and runners behind the benchmarks."""
