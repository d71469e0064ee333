"""Would prefill beside the decode steps (a second CUDA stream) beat prefill between them?

    python perf/experiments/overlap_probe.py --out FILE.json [--live 16 --context 4096
        --long-prompt 32768] [--prefill-sms N]

The serving loop runs prefill pieces between decode steps, so a piece's time adds to every
stream's inter-token gap (the long phase's ITL p50, ``perf/NOTES.md``, "Serving"). The decode
step is bandwidth-bound and a long prompt's prefill compute-bound: if they share the GPU well,
prefill on a side stream costs the streams only the contention. This measures, on the
Llama-3.1-8B shape: the step of ``--live`` slots (``--context`` tokens each) replayed alone; a
``--long-prompt`` prefill alone (into a free slot, every layer queued); then the prefill queued on
a low-priority side stream while the steps replay on a high-priority stream until it is done:
each step's time, and the prefill's. Timing by CUDA events; nothing else runs.

``--prefill-sms N``: the side stream is a CUDA green context's of ``N`` SMs (torch's beta
``torch.cuda.green_contexts``), so that the prefill leaves the other SMs to the steps; the
prefill is also timed alone in it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--live", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--long-prompt", type=int, default=32768)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prefill-sms", type=int, default=0)
    a = p.parse_args()

    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.graphs.prefill import prefill_pieces
    from minikv_compile.graphs.runtime import Request, engine_mode
    from minikv_compile.perf import harness as H

    dev = torch.device("cuda")
    model = H.build_model(a.model, dev, torch.bfloat16)
    cfg = MiniKVConfig.preset("snapkv", max_batch_size=2 * a.live, max_prompt_len=a.long_prompt,
                       max_new_tokens=1024)
    engine = minikv_compile(model, cfg)
    rt = engine.runtime
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with engine_mode():
        for slot in range(a.live):
            rt.admit(slot, Request(torch.randint(0, vocab, (a.context,), generator=g).tolist(),
                                   1024))
        key = rt.step_key()
        rt.prepare(*key)
        free = 2 * a.live - 1
        long_ids = torch.randint(0, vocab, (a.long_prompt,), generator=g).to(dev)

        def prefill_all() -> None:
            pieces = prefill_pieces(engine.adapter, rt.cache, [cfg], [free], [long_ids], 1)
            for _ in pieces:
                pass

        def timed_steps(n: int, stream) -> list:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(n)]
            with torch.cuda.stream(stream):
                for e0, e1 in events:
                    e0.record()
                    rt.runner.run(key)
                    e1.record()
            torch.cuda.synchronize()
            return [e0.elapsed_time(e1) for e0, e1 in events]

        high = torch.cuda.Stream(priority=-1)
        low = torch.cuda.Stream(priority=0)
        green = None
        if a.prefill_sms:
            from torch.cuda.green_contexts import GreenContext

            green = GreenContext.create(a.prefill_sms, torch.cuda.current_device())
            low = green.Stream()

        def on_low(fn) -> None:
            if green is not None:
                green.set_context()
            try:
                with torch.cuda.stream(low):
                    fn()
            finally:
                if green is not None:
                    green.pop_context()

        for _ in range(2):  # warm-up: the prefill kernels at this length, the graph
            prefill_all()
            timed_steps(5, high)
        torch.cuda.synchronize()
        prefill_low = None
        if green is not None:
            on_low(prefill_all)  # (its first launches in the green context)
            torch.cuda.synchronize()
            g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def timed_prefill() -> None:
                g0.record()
                prefill_all()
                g1.record()

            on_low(timed_prefill)
            torch.cuda.synchronize()
            prefill_low = round(g0.elapsed_time(g1), 1)

        alone = timed_steps(a.steps, high)
        p0, p1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        p0.record()
        prefill_all()
        p1.record()
        torch.cuda.synchronize()
        prefill_alone = p0.elapsed_time(p1)

        # Together: the steps replayed on the high-priority stream by a thread of their own
        # (one in flight, as the serving loop keeps them), while this thread queues the prefill
        # on the low one (its host waits, if any, hold this thread only); the steps that ran
        # inside the prefill's span count.
        low.wait_stream(torch.cuda.current_stream())
        high.wait_stream(torch.cuda.current_stream())
        q0, q1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stop, events = threading.Event(), []
        index = torch.cuda.current_device()

        def step_loop() -> None:
            torch.cuda.set_device(index)
            with engine_mode(), torch.cuda.stream(high):
                while not stop.is_set():
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    rt.runner.run(key)
                    e1.record()
                    e1.synchronize()
                    events.append((e0, e1))

        def queued_prefill() -> None:
            q0.record()
            prefill_all()
            q1.record()

        thread = threading.Thread(target=step_loop)
        thread.start()
        on_low(queued_prefill)
        q1.synchronize()
        stop.set()
        thread.join()
        torch.cuda.synchronize()
        span = q0.elapsed_time(q1)
        together = [e0.elapsed_time(e1) for e0, e1 in events
                    if q0.elapsed_time(e0) >= 0 and q0.elapsed_time(e1) <= span]
        prefill_together = span

    def summary(xs):
        xs = sorted(xs)
        return {"n": len(xs), "p50": round(statistics.median(xs), 3),
                "p90": round(xs[int(0.9 * (len(xs) - 1))], 3), "max": round(xs[-1], 3)}

    result = {"model": a.model, "live": a.live, "context": a.context, "bucket": key[0],
              "long_prompt": a.long_prompt, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__,
              "step_alone_ms": summary(alone), "prefill_alone_ms": round(prefill_alone, 1),
              "step_beside_prefill_ms": summary(together),
              "steps_per_s_beside_prefill": round(1000 * len(together) / prefill_together, 1),
              "prefill_beside_steps_ms": round(prefill_together, 1),
              "prefill_sms": a.prefill_sms or None, "prefill_alone_on_its_sms_ms": prefill_low,
              "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
              "interleaved_equivalent": "a gap holding a 50 ms piece costs every stream 50 ms"}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
