"""Where the scheduler's loop spends a long inter-token gap: streams running while long prompts
are admitted, in process (no HTTP), every loop call timed on the host.

    python perf/experiments/loop_trace.py --out FILE.json [--model llama3.1-8b] [--streams 24]
        [--long-prompt 32768] [--longs 3]

Builds the serving engine (the `serve` benchmark's capacity: 64 slots, prompts <= 32768, 512 new
tokens), warms the scheduler up, starts ``--streams`` requests (prompts 2k-4k, 512 tokens, one
every 50 ms), then submits a ``--long-prompt`` request every 4 s. Each delta's arrival (on the
loop thread, through ``on_delta``) is recorded per request; every interval over ``--gap-ms`` is
printed with the loop calls that overlap it (``_admit_piece`` with the layers it ran, ``rt.step``,
the wait of ``_read_pending``, ``rt.poll``, ``_collect``).
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time

import torch


_LOOP = ("_admit_piece", "_prefill_layers", "step", "_read_pending", "poll", "_collect")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--streams", type=int, default=24)
    p.add_argument("--long-prompt", type=int, default=32768)
    p.add_argument("--longs", type=int, default=3)
    p.add_argument("--long-every-s", type=float, default=4.0)
    p.add_argument("--stream-prompt", default="2048,4096")
    p.add_argument("--max-prompt", type=int, default=32768)
    p.add_argument("--gap-ms", type=float, default=100.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sync-warn", action="store_true",
                   help="torch.cuda's sync debug mode 'warn' while the loop runs, each "
                        "synchronizing call's stack printed once")
    a = p.parse_args()

    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.perf import harness as H
    from minikv_compile.perf.serve_worker import SyntheticTokenizer
    from minikv_compile.scheduler import Scheduler, ServeRequest

    t0 = time.perf_counter()
    model = H.build_model(a.model, torch.device(a.device),
                          torch.bfloat16 if a.device == "cuda" else torch.float32)
    engine = minikv_compile(model, MiniKVConfig.preset("snapkv", max_batch_size=a.max_batch,
                                                max_prompt_len=max(a.max_prompt, a.long_prompt),
                                                max_new_tokens=512))
    sched = Scheduler(engine, SyntheticTokenizer(), max_queue=1024)
    sched.warm_up()
    print(f"ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    V = int(engine.adapter.vocab_size)
    # one long prefill alone first (after warm_up's at capacity: 1.91 s at 32k on the H100,
    # 6.67 s when it was a process's first)
    t0 = time.perf_counter()
    sched.start()
    print("lone:", sched.submit(ServeRequest([rng.randrange(V) for _ in range(a.long_prompt)], 2)).result()[1])
    sched.shutdown()
    sched = Scheduler(engine, SyntheticTokenizer(), max_queue=1024)
    sched.ready = True
    print(f"a lone long prefill: {time.perf_counter() - t0:.2f} s", flush=True)

    trace = []  # (name, t0, t1, extra)

    def timed(obj, name, extra=None):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                trace.append((name, s, time.perf_counter(), extra(args) if extra else None))
        setattr(obj, name, wrapper)

    rt = sched.rt
    timed(sched, "_admit_piece")
    timed(sched, "_read_pending")
    timed(sched, "_collect", lambda args: len(args[0]))
    timed(rt, "step")
    timed(rt, "poll")
    # the admission's parts, timed on the host: a long one holds a synchronization
    from minikv_compile.graphs import prefill as P
    adapter, state = engine.adapter, rt.state
    for obj, name in ((P, "_attend_and_store"), (P, "select_tokens"), (P, "token_scores"),
                      (adapter, "qkv"), (adapter, "finish_layer"), (adapter, "logits"),
                      (adapter, "embed"), (state, "choose"), (state, "record"), (rt, "release"),
                      (rt, "poll_later")):
        timed(obj, name)
    if a.sync_warn:
        import traceback
        import warnings
        seen = set()

        def show(message, category, filename, lineno, file=None, line=None):
            stack = "".join(traceback.format_stack(limit=14)[:-2])
            if stack not in seen:
                seen.add(stack)
                print(f"SYNC: {message}\n{stack}", flush=True)
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
    timed(sched, "_prefill_layers", lambda args: args[1])  # (its prompt tokens)

    arrivals = {}
    lock = threading.Lock()

    def on_delta_for(rid):
        def on_delta(delta):
            if delta.token_ids:
                with lock:
                    arrivals.setdefault(rid, []).append(time.perf_counter())
        return on_delta

    sched.start()
    t_start = time.perf_counter()
    for i in range(a.streams):
        n = rng.randint(*map(int, a.stream_prompt.split(",")))
        sched.submit(ServeRequest([rng.randrange(V) for _ in range(n)], 512),
                     on_delta_for(f"s{i}"))
        time.sleep(0.05)
    time.sleep(3.0)
    longs = []
    for j in range(a.longs):
        longs.append(time.perf_counter())
        sched.submit(ServeRequest([rng.randrange(V) for _ in range(a.long_prompt)], 16),
                     on_delta_for(f"long{j}"))
        time.sleep(a.long_every_s)
    time.sleep(2.0)
    t_end = time.perf_counter()
    sched.shutdown()

    gaps = []
    intervals = []
    for rid, ts in arrivals.items():
        if rid.startswith("long"):
            continue
        for x, y in zip(ts, ts[1:]):
            intervals.append((y - x) * 1e3)
            if (y - x) * 1e3 > a.gap_ms:
                gaps.append((x, y, rid))
    gaps.sort()
    # one report per distinct gap (streams share them)
    merged = []
    for x, y, rid in gaps:
        if merged and x < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], y)
            merged[-1][2] += 1
        else:
            merged.append([x, y, 1])
    intervals.sort()
    q = lambda f: intervals[min(len(intervals) - 1, int(f * len(intervals)))] if intervals else None
    rel = lambda t: round((t - t_start) * 1e3, 2)
    print(f"{len(intervals)} intervals: p50 {q(0.5):.2f} ms, p99 {q(0.99):.2f} ms, "
          f"max {intervals[-1]:.1f} ms; long prompts submitted at "
          f"{[rel(t) for t in longs]} ms", flush=True)
    report = []
    for x, y, n in merged:
        calls = [(name, rel(s), round((e - s) * 1e3, 2), extra) for name, s, e, extra in trace
                 if e >= x - 0.01 and s <= y and (e - s > 2e-3 or name in _LOOP)]
        report.append(dict(start_ms=rel(x), gap_ms=round((y - x) * 1e3, 2), streams=n,
                           calls=calls))
        print(f"gap {rel(x)} .. {rel(y)} ms ({(y - x) * 1e3:.1f} ms, {n} intervals):", flush=True)
        for c in calls:
            print(f"    {c}")
    with open(a.out, "w") as f:
        json.dump(dict(intervals_ms=dict(p50=q(0.5), p99=q(0.99), max=intervals[-1],
                                         n=len(intervals)),
                       longs_ms=[rel(t) for t in longs], gaps=report, window_s=t_end - t_start,
                       trace=[(n, rel(s), round((e - s) * 1e3, 3), x) for n, s, e, x in trace]),
                  f)


if __name__ == "__main__":
    main()
