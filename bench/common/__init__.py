"""Shared by the benchmarks: the seeded workload, the offline oracle, the static cost model, RESULTS.md reports."""
