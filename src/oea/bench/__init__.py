"""Benchmarks: routing microbenchmark, MoE-layer A/B latency, serving A/B client."""
