"""Benchmarks: `photon bench throughput|bubble` (each prints JSON lines; the last is the summary)."""
