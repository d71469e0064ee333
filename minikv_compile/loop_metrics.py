"""The scheduler's counters and latency histograms (``Scheduler.metrics``; ``/metrics`` renders
them in Prometheus' format)."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List

__all__ = ["LATENCY_BUCKETS", "Metrics"]

# Histogram bucket upper bounds (seconds) of the latency metrics.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Metrics:
    """Counters of the loop (read them through ``Scheduler.metrics``)."""

    requests: Dict[str, int] = field(default_factory=lambda: collections.Counter())
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: List[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    ttft_sum: float = 0.0
    itl: List[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    itl_sum: float = 0.0
    # a first token's wait in parts: in the queue (submission to the start of its prefill),
    # then its prefill (or restore and tail) until its last piece is launched
    queue: List[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    queue_sum: float = 0.0
    prefill: List[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    prefill_sum: float = 0.0
    steps: int = 0
    prefills: int = 0  # prefill passes completed (several prompts each when batched)
    keep_failures: int = 0  # contexts the prefix cache could not keep (no memory for the copy)

    def observe(self, hist: List[int], seconds: float) -> None:
        hist[next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b),
                  len(LATENCY_BUCKETS))] += 1
