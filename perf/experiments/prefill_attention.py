"""Device experiment: what SnapKV's prefill gains by dropping selective attention's second pass
(it sums every query's attention, which only the h2o-type rules read), and which attention
then: Triton's first pass alone (``ops.causal_attention``) or SDPA.

    python perf/experiments/prefill_attention.py --out FILE.json    # after perf/gpu_check.sh
    python perf/experiments/prefill_attention.py --out F --tiny     # CPU plumbing check

1. The attention of one layer of one prompt (Llama-3.1-8B's heads: 32 query / 8 KV heads of 128,
   bf16) at several lengths: ``ops.selective_attention``; ``ops.causal_attention`` (its first
   pass alone, the product path); SDPA with ``enable_gqa`` as torch picks
   its backend; SDPA pinned to each backend that takes the call; cuDNN over keys and values
   repeated to the query heads (the repeat timed in); and SnapKV's window scores, which every
   SDPA row needs on top.
2. The first and second call of each attention at prompt lengths not seen before: what a
   server meets with nearly every request.
3. One prompt admitted whole into the engine (random 8B weights, the library's default config:
   SnapKV, half the prompt kept), synchronized: the product path (``ops.causal_attention``)
   against the same engine with SDPA patched in, and with ``CUMULATIVE_RULES`` patched to
   include ``"snapkv"`` (selective attention, the path before), alternating, median of
   ``--repeats`` after one warm-up each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sdpa(q, k, v, scale, backend=None):
    """Causal SDPA over grouped KV heads, on ``backend`` alone or as torch picks it."""
    from torch.nn.attention import sdpa_kernel

    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=True)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=True)


def _ms(fn, device, repeats):
    """Median wall ms of ``fn`` (synchronized), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def attention_rows(L, device, dtype, repeats):
    from minikv_compile import ops
    from minikv_compile.graphs.selection import snapkv_scores
    from torch.nn.attention import SDPBackend

    g = torch.Generator(device=device).manual_seed(L)
    Hq, Hkv, D = (32, 8, 128) if device.type == "cuda" else (4, 2, 32)
    q = torch.randn(1, Hq, L, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, Hkv, L, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, Hkv, L, D, device=device, dtype=dtype, generator=g)
    scale = D ** -0.5
    rows = {"selective_attention": lambda: ops.selective_attention(q, k, v, scale=scale),
            "causal_attention": lambda: ops.causal_attention(q, k, v, scale=scale),
            "sdpa (torch's choice)": lambda: _sdpa(q, k, v, scale)}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        rows[f"sdpa {name.lower()}"] = (
            lambda backend=getattr(SDPBackend, name): _sdpa(q, k, v, scale, backend))
    rows["sdpa cudnn, k/v repeated"] = lambda: _sdpa(  # a copy of its KV head per query head
        q, k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1), scale,
        SDPBackend.CUDNN_ATTENTION)
    rows["snapkv window scores"] = lambda: snapkv_scores(q, k, scale, 32, 7)
    # the fp32 reference through SDPA's math backend holds L x L scores: up to 8k only
    reference = (F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                scale=scale, enable_gqa=True)
                 if L <= 8192 else None)
    out = {}
    for name, fn in rows.items():
        try:
            ms = _ms(fn, device, repeats)
        except Exception as e:  # a backend that does not take this call
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            continue
        row = {"ms": round(ms, 3)}
        if name != "snapkv window scores" and reference is not None:
            res = fn()
            res = res[0] if isinstance(res, tuple) else res
            row["max_abs_err_vs_fp32"] = float((res.float() - reference).abs().max())
        out[name] = row
    return out


def first_calls(lengths, device, dtype):
    """Per attention: ms of its first and second call at prompt lengths this process has not
    seen before (a server sees a new length with nearly every request). Each attention gets
    lengths of its own, so that no plan or kernel built for another one is reused."""
    from minikv_compile import ops
    from torch.nn.attention import SDPBackend

    rows = {"causal_attention (Triton pass 1)": lambda q, k, v, scale:
            ops.causal_attention(q, k, v, scale=scale),
            "sdpa cudnn": lambda q, k, v, scale: _sdpa(q, k, v, scale,
                                                        SDPBackend.CUDNN_ATTENTION),
            "sdpa flash": lambda q, k, v, scale: _sdpa(q, k, v, scale,
                                                        SDPBackend.FLASH_ATTENTION)}
    Hq, Hkv, D = (32, 8, 128) if device.type == "cuda" else (4, 2, 32)
    out = {}
    for offset, (name, fn) in enumerate(rows.items()):
        out[name] = []
        for L in lengths:
            L += 2 * offset + 1  # odd, and its own
            q = torch.randn(1, Hq, L, D, device=device, dtype=dtype)
            k = torch.randn(1, Hkv, L, D, device=device, dtype=dtype)
            v = torch.randn(1, Hkv, L, D, device=device, dtype=dtype)
            times = []
            try:
                for _ in range(2):
                    _sync(device)
                    t0 = time.perf_counter()
                    fn(q, k, v, D ** -0.5)
                    _sync(device)
                    times.append(round((time.perf_counter() - t0) * 1e3, 2))
            except RuntimeError as e:  # a backend that does not take this call (the CPU)
                out[name].append({"L": L, "error": str(e)[:120]})
                continue
            out[name].append({"L": L, "first_ms": times[0], "second_ms": times[1]})
    return out


def prefill_rows(L, model, device, repeats):
    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.graphs import prefill as prefill_module
    from minikv_compile.graphs.runtime import Request

    config = MiniKVConfig.preset("snapkv", max_batch_size=1, max_prompt_len=L, max_new_tokens=16, compile=False,
                          cuda_graphs=False)
    cm = minikv_compile(model, config)
    rt = cm.runtime
    request = Request(torch.randint(3, model.config.vocab_size, (L,)).tolist(), 1)
    rules, causal = prefill_module.CUMULATIVE_RULES, prefill_module.ops.causal_attention
    # (selection rules that run selective attention, the attention of the others)
    paths = {"causal_attention (product)": (rules, causal), "sdpa": (rules, _sdpa),
             "selective attention (before)": (rules + ("snapkv",), causal)}

    def admit():
        rt.admit(0, request)
        _sync(device)
        rt.release(0)
    times = {name: [] for name in paths}
    try:
        for rep in range(repeats + 1):  # the first is the warm-up
            for name, (patched, attention) in paths.items():
                prefill_module.CUMULATIVE_RULES = patched
                prefill_module.ops.causal_attention = attention
                _sync(device)
                t0 = time.perf_counter()
                admit()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        prefill_module.CUMULATIVE_RULES, prefill_module.ops.causal_attention = rules, causal
    del cm, rt
    return {name: round(statistics.median(t), 1) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, fp32")
    p.add_argument("--lengths", default="2048,8192,16384,32768")
    p.add_argument("--prefill-lengths", default="4096,16384,32768")
    p.add_argument("--first-lengths", default="3000,5000,9000,17000,30000")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    from minikv_compile.perf import harness

    if a.tiny:
        device, dtype, shape = torch.device("cpu"), torch.float32, "tiny"
        a.lengths, a.prefill_lengths, a.repeats = "64,128", "96", 1
        a.first_lengths = "40,80"
        env = {"device": "cpu", "torch": torch.__version__}
    else:
        from minikv_compile.perf.measure import row_environment

        device, dtype, shape = torch.device("cuda"), torch.bfloat16, "llama3.1-8b"
        env = row_environment()
    result = {"environment": env, "attention": {}, "prefill_ms": {}}
    result["first_calls"] = first_calls([int(x) for x in a.first_lengths.split(",")], device,
                                        dtype)
    for name, rows in result["first_calls"].items():
        print(f"first calls at new lengths, {name}: " + ", ".join(
            f"L {r['L']} {r.get('first_ms')} / {r.get('second_ms')} ms" for r in rows))
    for L in (int(x) for x in a.lengths.split(",")):
        result["attention"][L] = attention_rows(L, device, dtype, a.repeats)
        print(f"attention, L {L}:")
        for name, row in result["attention"][L].items():
            print(f"  {name:>28}: {row}")
    model = harness.build_model(shape, device, dtype)
    for L in (int(x) for x in a.prefill_lengths.split(",")):
        result["prefill_ms"][L] = prefill_rows(L, model, device, a.repeats)
        print(f"prefill of one {L}-token prompt (ms): {result['prefill_ms'][L]}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
