"""``/metrics``: the scheduler's counters in Prometheus' text exposition format."""
from __future__ import annotations

import math
from typing import List, Tuple

from ..config import MiniKVConfig
from ..scheduler import LATENCY_BUCKETS, Scheduler


def render(scheduler: Scheduler, config: MiniKVConfig, invalid: int) -> str:
    """The scheduler's counters in Prometheus' text exposition format (version 0.0.4)."""
    m = scheduler.metrics
    lines: List[str] = []

    def metric(name: str, kind: str, help_: str, samples: List[Tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value:g}" if isinstance(value, float) else
                     f"{name}{labels} {value}" for labels, value in samples)

    outcomes = {"stop": 0, "length": 0, "cancelled": 0, "error": 0, "rejected": 0,
                **dict(m.requests), "invalid": invalid}
    metric("minikv_requests_total", "counter",
           "Requests by outcome (stop, length, cancelled, error; rejected: queue full; invalid: "
           "answered 4xx: bad input, or refused at the door (key, host, origin, content type, "
           "body size or time)).", [(f'{{outcome="{k}"}}', v) for k, v in sorted(outcomes.items())])
    metric("minikv_prompt_tokens_total", "counter", "Prompt tokens admitted.",
           [("", m.prompt_tokens)])
    metric("minikv_completion_tokens_total", "counter", "Tokens generated.",
           [("", m.completion_tokens)])
    metric("minikv_decode_steps_total", "counter", "Decode steps replayed.", [("", m.steps)])
    metric("minikv_prefill_passes_total", "counter",
           "Prefill passes (each admits one or several waiting prompts).", [("", m.prefills)])
    metric("minikv_queue_depth", "gauge", "Requests waiting for a slot.",
           [("", scheduler.queue_depth)])
    metric("minikv_slots_in_use", "gauge", "Slots holding a request.",
           [("", scheduler.slots_in_use)])
    metric("minikv_slots", "gauge", "Slots in all (max_batch_size).",
           [("", config.max_batch_size)])
    metric("minikv_kv_bytes_in_use", "gauge",
           "KV cache bytes of the running requests (prompt + max_tokens each).",
           [("", scheduler.kv_bytes_in_use())])
    pool = scheduler.pool
    metric("minikv_prefix_cache_queries_total", "counter",
           "Prompt tokens looked up in the prefix cache (requests that may reuse a context).",
           [("", scheduler.prefix_queries)])
    metric("minikv_prefix_cache_hits_total", "counter",
           "Prompt tokens admitted from a resident context instead of prefilled.",
           [("", scheduler.prefix_hits)])
    metric("minikv_prefix_cache_bytes", "gauge",
           "Bytes of the contexts kept for reuse, by tier (device: within "
           "--prefix-cache-gpu-bytes; host: within --prefix-cache-host-bytes).",
           [('{tier="device"}', pool.nbytes), ('{tier="host"}', pool.host_nbytes)])
    metric("minikv_prefix_cache_entries", "gauge", "Contexts kept for reuse.",
           [("", len(pool))])
    metric("minikv_prefix_cache_evictions_total", "counter",
           "Contexts dropped from the pool to make room (least recently used first).",
           [("", pool.evictions)])
    metric("minikv_prefix_cache_keep_failures_total", "counter",
           "Contexts that could not be kept (no memory for the copy): the request went on, the "
           "next one prefills them.", [("", scheduler.metrics.keep_failures)])
    metric("minikv_prefix_cache_disk_loads_total", "counter",
           "Contexts read from --prefix-cache-dir on a miss.",
           [("", 0 if scheduler.disk is None else scheduler.disk.loads)])
    metric("minikv_ready", "gauge", "1 once every bucket is compiled and captured.",
           [("", int(scheduler.ready))])
    runner = scheduler.engine.runtime.runner  # what proves the graphs are replayed, not rebuilt
    metric("minikv_compiled_graphs_total", "counter",
           "Compiled graphs of the decode step run (all before ready; one more while serving "
           "is a recompile).", [("", runner.compiles)])
    metric("minikv_loaded_graphs_total", "counter",
           "Of them, graphs an earlier process compiled and saved (a restart's).",
           [("", runner.loads)])
    metric("minikv_cuda_graphs", "gauge", "CUDA graphs captured, one per (bucket, mode).",
           [("", len(runner.graphs))])
    metric("minikv_cuda_graph_replays_total", "counter", "Decode steps replayed from a CUDA graph.",
           [("", runner.replays)])
    for name, hist, total, help_ in (
            ("minikv_time_to_first_token_seconds", m.ttft, m.ttft_sum,
             "Seconds from submission to the first token."),
            ("minikv_inter_token_latency_seconds", m.itl, m.itl_sum,
             "Seconds between consecutive tokens of a request."),
            ("minikv_request_queue_seconds", m.queue, m.queue_sum,
             "Seconds from submission to the start of the request's prefill."),
            ("minikv_request_prefill_seconds", m.prefill, m.prefill_sum,
             "Seconds of the request's prefill (a hit's restore and tail), from its start to "
             "its last piece launched.")):
        counts, samples, running = list(hist), [], 0
        for bound, count in zip(LATENCY_BUCKETS + (math.inf,), counts):
            running += count
            samples.append((f'_bucket{{le="{"+Inf" if bound == math.inf else f"{bound:g}"}"}}',
                            running))
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        lines.extend(f"{name}{suffix} {value}" for suffix, value in samples)
        lines.extend([f"{name}_sum {total:.6f}", f"{name}_count {running}"])
    return "\n".join(lines) + "\n"
