"""Benchmarks and workload tooling behind `sarathictl bench`."""
