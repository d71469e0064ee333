"""Benchmarks and NVML-based reports (``python -m minikv_compile.perf``)."""
