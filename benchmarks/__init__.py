"""Benchmark scripts (`python benchmarks/bench_<area>.py --help`) and their shared harness."""
