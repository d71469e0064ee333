"""Does SmolLM2-135M-Instruct carry MiniCache's premise, and where (if anywhere) is merging safe?

    python perf/experiments/minicache_similarity.py [--docs 6] [--calibration 2]
        [--prefix 2048] [--continuation 160] [--threads 1] [--out perf/results/minicache]

Issue 49's first part, on the CPU in fp32. Real prose from the accuracy harness's perplexity
sampler (``perf.accuracy.tasks.ppl_samples``: KJV and Shakespeare alternating, ``--prefix`` +
``--continuation`` tokens from a line start). Every passage's prefix is prefilled once by the
unwrapped HF model; its cache (keys after RoPE, values) gives

1. the similarity: per layer pair (l, l+1) and KV head, the cosine of the two layers' states of
   each token, keys and values apart (mean, p10/p50/p90; and the mean over tokens of the best of
   the three heads of layer l+1, in case heads do not line up across layers). Written to
   ``similarity.json`` and plotted to ``similarity.png``.
2. the variants: the prefix's cache transformed (merged and restored with
   ``ops/minicache.py``, quantized with ``ops/quant.py``'s references), then the continuation
   teacher-forced over it in one HF forward (its own tokens' KV stay exact, as the engine's ring
   would hold them; the first continuation token's log-probability comes from the prefill, which
   no cache compression touches). Paired perplexity against the same configuration unmerged
   (16-bit: the cache rounded to fp16; b-bit: every layer quantized, keys per channel, values per
   token, groups of 16), on the passages after the ``--calibration`` first ones (those choose the
   heads of the head-selected variants, so the choice is not fitted to the measured text).

KV bytes are the prefix's cache: an unmerged (layer, head, K or V) plane of n tokens costs n * D
* 2 (fp16) or, b-bit, ``q * D * (b/8 + 4/16) + (n - q) * D * 2`` with q = n // 16 * 16 (fp16 scale
and zero per group of 16; the rest in the fp16 ring). A merged pair plane: its M = T - R
directions at the same precision, 2 * M fp16 magnitudes, 2 x the R retained tokens at the same
precision, and R int32 positions.

An identity check first: the untouched cache through this evaluation must give the log-probs of
one plain HF forward over prefix + continuation (within 1e-4 nats per token); the run stops if not.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
from transformers import DynamicCache

from minikv_compile.models.smollm2 import load_smollm2
from minikv_compile.ops.minicache import merge_pair, restore
from minikv_compile.ops.quant import (dequantize_keys_ref, dequantize_values_ref, quantize_keys_ref,
                                      quantize_values_ref)
from minikv_compile.perf.accuracy.tasks import HFCodec, Plan, ppl_samples, real_corpora

KINDS = ("k", "v")
GROUP = 16
T_SLERP = 0.6  # the default


# -- the model and its cache ----------------------------------------------------------------------


@torch.no_grad()
def prefill(model, prompt: List[int]):
    """(keys, values, last logits): per layer ``(1, H_kv, T, D)`` fp32 as HF caches them."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    keys = [layer.keys.clone() for layer in cache.layers]
    values = [layer.values.clone() for layer in cache.layers]
    return keys, values, out.logits[0, -1].float()


@torch.no_grad()
def continuation_logprobs(model, keys, values, last_logits, target: List[int]) -> torch.Tensor:
    """log p(target[j] | prefix cache, target[:j]): ``(len(target),)`` fp64."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k.clone(), v.clone(), i)
    ids = torch.tensor([target[:-1]])
    logits = model(ids, past_key_values=cache, use_cache=True).logits[0].float()
    logits = torch.cat([last_logits[None], logits])
    tgt = torch.tensor(target)
    return logits.log_softmax(-1).gather(-1, tgt[:, None])[:, 0].double()


@torch.no_grad()
def plain_logprobs(model, prompt: List[int], target: List[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + target])
    logits = model(ids, logits_to_keep=len(target) + 1).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(target)[:, None])[:, 0].double()


# -- similarity -----------------------------------------------------------------------------------


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., D) x (..., D) -> (...) cosine, 0 where a vector is zero."""
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, (a * b).sum(-1) / den.clamp_min(1e-30), 0.0)


def pair_cosines(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per pair (l, l+1) and head, every token's cosine: ``(L - 1, H, T)``."""
    return torch.stack([cosines(states[l][0], states[l + 1][0]) for l in range(len(states) - 1)])


def cross_head_cosines(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean over tokens of cos(head i of layer l, head j of layer l+1): ``(L - 1, H, H)``."""
    out = []
    for l in range(len(states) - 1):
        a, b = states[l][0], states[l + 1][0]                       # (H, T, D)
        out.append(cosines(a[:, None], b[None]).mean(-1))           # (H, H)
    return torch.stack(out)


def summarize_similarity(per_doc: Dict[str, List[torch.Tensor]], cross: Dict[str, List[torch.Tensor]]
                         ) -> dict:
    out = {}
    for kind in KINDS:
        cos = torch.cat(per_doc[kind], dim=-1)                      # (L-1, H, tokens of all docs)
        q = torch.quantile(cos.float(), torch.tensor([0.1, 0.5, 0.9]), dim=-1)   # (3, L-1, H)
        x = torch.stack(cross[kind]).mean(0)                        # (L-1, H, H)
        out[kind] = {
            "mean": cos.mean(-1).tolist(), "p10": q[0].tolist(), "p50": q[1].tolist(),
            "p90": q[2].tolist(), "share_above_0.9": (cos > 0.9).float().mean(-1).tolist(),
            "cross_head_mean": x.tolist(), "best_head_mean": x.amax(-1).tolist(),
        }
    return out


def plot_similarity(sim: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no PNG written")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, kind, title in zip(axes, KINDS, ("keys (after RoPE)", "values")):
        s = sim[kind]
        pairs = list(range(len(s["mean"])))
        for h in range(len(s["mean"][0])):
            mean = [row[h] for row in s["mean"]]
            line, = ax.plot(pairs, mean, marker="o", ms=3, label=f"KV head {h}: mean")
            ax.fill_between(pairs, [r[h] for r in s["p10"]], [r[h] for r in s["p90"]],
                            color=line.get_color(), alpha=0.12)
        ax.plot(pairs, [max(r) for r in s["best_head_mean"]], "k--", lw=1,
                label="best head pairing (mean)")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(f"SmolLM2-135M: cos(layer l, layer l+1), {title}")
        ax.set_xlabel("pair (l, l+1), l =")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cosine per token (band: p10-p90)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- variants -------------------------------------------------------------------------------------


def plane_bytes(n: int, D: int, bits: int) -> float:
    if bits == 16:
        return n * D * 2
    q = n // GROUP * GROUP
    return q * D * (bits / 8 + 4 / GROUP) + (n - q) * D * 2


def at_precision(x: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """``(1, H, n, D)`` as the cache would hold it: fp16, or b-bit for the first n // 16 * 16
    tokens (keys per channel, values per token) and fp16 for the rest."""
    if bits == 16:
        return x.half().float()
    n = x.shape[2]
    q = n // GROUP * GROUP
    head, tail = x[:, :, :q], x[:, :, q:].half().float()
    if q:
        if kind == "k":
            head = dequantize_keys_ref(*quantize_keys_ref(head, bits, GROUP), bits, GROUP, torch.float32)
        else:
            head = dequantize_values_ref(*quantize_values_ref(head, bits, GROUP), bits, GROUP,
                                         torch.float32)
    return torch.cat([head, tail], dim=2)


def pairs_from(start: int, num_layers: int) -> List[int]:
    """Lower layers of the disjoint pairs (start, start+1), (start+2, start+3), ..."""
    return list(range(start, num_layers - 1, 2))


def apply_variant(keys, values, units, retain: float, bits: int):
    """The cache a variant leaves: every plane at ``bits``, the ``units`` ((l, head, kind): pair
    (l, l+1)) merged. Returns (keys, values, stats) with the merged tokens' cosine and the
    restore's relative error."""
    states = {"k": [at_precision(k, "k", bits) for k in keys],
              "v": [at_precision(v, "v", bits) for v in values]}
    original = {"k": keys, "v": values}
    cos_sum, err_sum, n = 0.0, 0.0, 0
    for l, h, kind in units:
        a, b = original[kind][l][:, h:h + 1], original[kind][l + 1][:, h:h + 1]    # (1, 1, T, D)
        pair = merge_pair(a, b, t=T_SLERP, retain=retain)
        pair = pair._replace(direction=at_precision(pair.direction, kind, bits),
                             retained=torch.stack([at_precision(r, kind, bits) for r in pair.retained]))
        xa, xb = restore(pair)
        states[kind][l][:, h:h + 1], states[kind][l + 1][:, h:h + 1] = xa, xb
        merged = torch.ones(a.shape[2], dtype=torch.bool)
        merged[pair.retained_index[0, 0]] = False
        cos_sum += float(cosines(a[0, 0], b[0, 0])[merged].sum())
        for x_hat, x in ((xa, a), (xb, b)):
            err_sum += float(((x_hat - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))[0, 0][merged].sum()) / 2
        n += int(merged.sum())
    stats = {"merged_tokens_mean_cos": cos_sum / n if n else None,
             "merged_tokens_rel_error": err_sum / n if n else None}
    return states["k"], states["v"], stats


def variant_bytes(units, retain: float, bits: int, T: int, L: int, H: int, D: int) -> float:
    total = 2 * L * H * plane_bytes(T, D, bits)
    R = min(T, math.ceil(retain * T))
    M = T - R
    merged = plane_bytes(M, D, bits) + 2 * M * 2 + 2 * plane_bytes(R, D, bits) + R * 4
    return total - len(units) * (2 * plane_bytes(T, D, bits) - merged)


def greedy_units(sim_mean: Dict[str, torch.Tensor], kinds: Sequence[str], min_cos: float = -1.0,
                 limit: int = 10 ** 9) -> List[Tuple[int, int, str]]:
    """Disjoint (pair, head, kind) units, most similar first (calibration means), each layer's
    head plane in at most one pair."""
    cands = sorted(((float(sim_mean[k][l, h]), l, h, k) for k in kinds
                    for l in range(sim_mean[k].shape[0]) for h in range(sim_mean[k].shape[1])),
                   reverse=True)
    used, out = set(), []
    for c, l, h, k in cands:
        if c < min_cos or len(out) == limit:
            break
        if (l, h, k) in used or (l + 1, h, k) in used:
            continue
        used |= {(l, h, k), (l + 1, h, k)}
        out.append((l, h, k))
    return sorted(out)


def units_for_ratio(sim_mean, kinds, retain, bits, ratio, T, L, H, D):
    """The fewest most-similar units whose bytes reach ``ratio`` x fewer than unmerged (None if
    merging every disjoint unit does not)."""
    everything = greedy_units(sim_mean, kinds)
    base = 2 * L * H * plane_bytes(T, D, bits)
    for n in range(1, len(everything) + 1):
        units = greedy_units(sim_mean, kinds, limit=n)
        if base / variant_bytes(units, retain, bits, T, L, H, D) >= ratio:
            return units
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--calibration", type=int, default=2)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=160)
    p.add_argument("--out", default="perf/results/minicache")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on the loaded 2-core machine a second thread's spinning "
                        "cost more CPU than it saved)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    start_time = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    cfg = model.config
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    plan = Plan("minicache", (), (), 0, 0, a.docs, a.prefix, a.continuation, 0, 0, 0, 1, 0)
    docs = ppl_samples(HFCodec(tokenizer), real_corpora(), plan)
    print(f"[{time.perf_counter() - start_time:6.1f}s] model and {len(docs)} passages loaded", flush=True)

    caches, cos_all, cos_calib, cross = [], {k: [] for k in KINDS}, {k: [] for k in KINDS}, {k: [] for k in KINDS}
    identity = []
    for i, doc in enumerate(docs):
        keys, values, last = prefill(model, doc["prompt"])
        for kind, states in (("k", keys), ("v", values)):
            c = pair_cosines(states)
            cos_all[kind].append(c)
            cross[kind].append(cross_head_cosines(states))
            if i < a.calibration:
                cos_calib[kind].append(c)
        if i >= a.calibration:
            lp = continuation_logprobs(model, keys, values, last, doc["target"])
            ref = plain_logprobs(model, doc["prompt"], doc["target"])
            identity.append(float((lp - ref).abs().max()))
            caches.append((doc, keys, values, last))
        print(f"[{time.perf_counter() - start_time:6.1f}s] passage {i} ({doc['source']}) prefilled",
              flush=True)
    if max(identity) > 1e-4:
        raise SystemExit(f"identity check failed: the untouched cache's log-probs differ from one "
                         f"plain forward by up to {max(identity):.3g} nats")
    sim = summarize_similarity(cos_all, cross)
    calib_mean = {k: torch.cat(cos_calib[k], dim=-1).mean(-1) for k in KINDS}   # (L-1, H)
    plotted = plot_similarity(sim, out / "similarity.png")

    T = a.prefix
    variants = []   # (name, units, retain, bits)
    for bits in (16, 4, 2):
        variants.append((f"{bits}b unmerged", [], 0.0, bits))
    for start in (0, 8, 15, 22, 26):
        for kinds in (("k", "v"), ("v",)):
            for retain in (0.05, 0.2, 0.5):
                units = [(l, h, k) for l in pairs_from(start, L) for h in range(H) for k in kinds]
                variants.append((f"16b from {start}, {'KV' if len(kinds) == 2 else 'V'}, retain {retain}",
                                 units, retain, 16))
    for retain in (0.05, 0.2):
        for kinds in (("k", "v"), ("v",)):
            units = units_for_ratio(calib_mean, kinds, retain, 16, 1.25, T, L, H, D)
            if units:
                variants.append((f"16b most similar heads to 1.25x, {'KV' if len(kinds) == 2 else 'V'}, "
                                 f"retain {retain}", units, retain, 16))
    for min_cos in (0.5, 0.3):
        units = greedy_units(calib_mean, ("k", "v"), min_cos=min_cos)
        variants.append((f"16b heads with cos >= {min_cos}, retain 0.05", units, 0.05, 16))
    for bits in (4, 2):
        for start, kinds, retain in ((22, ("k", "v"), 0.05), (22, ("k", "v"), 0.2), (22, ("v",), 0.05),
                                     (26, ("k", "v"), 0.05), (15, ("k", "v"), 0.2)):
            units = [(l, h, k) for l in pairs_from(start, L) for h in range(H) for k in kinds]
            variants.append((f"{bits}b from {start}, {'KV' if len(kinds) == 2 else 'V'}, retain {retain}",
                             units, retain, bits))
        units = units_for_ratio(calib_mean, ("k", "v"), 0.05, bits, 1.25, T, L, H, D)
        if units:
            variants.append((f"{bits}b most similar heads to 1.25x, KV, retain 0.05", units, 0.05, bits))

    rows = []
    base_nll = {}
    for name, units, retain, bits in variants:
        t0 = time.perf_counter()
        nll, tokens, per_doc, stats = 0.0, 0, [], None
        for doc, keys, values, last in caches:
            k2, v2, stats = apply_variant(keys, values, units, retain, bits)
            lp = continuation_logprobs(model, k2, v2, last, doc["target"])
            nll -= float(lp.sum())
            tokens += len(doc["target"])
            per_doc.append(-float(lp.sum()))
        if not units:
            base_nll[bits] = per_doc
        base = base_nll[bits]
        ratios = [math.exp((x - y) / a.continuation) for x, y in zip(per_doc, base)]
        byte_ratio = 2 * L * H * plane_bytes(T, D, bits) / variant_bytes(units, retain, bits, T, L, H, D)
        row = {"name": name, "bits": bits, "retain": retain, "units": len(units),
               "pairs": sorted({l for l, _, _ in units}), "kinds": sorted({k for _, _, k in units}),
               "kv_bytes": variant_bytes(units, retain, bits, T, L, H, D),
               "bytes_ratio": byte_ratio, "ppl": math.exp(nll / tokens),
               "ppl_ratio": math.exp((nll - sum(base)) / tokens),
               "ppl_ratio_vs_fp16": math.exp((nll - sum(base_nll[16])) / tokens),
               "per_doc_ppl_ratio": ratios, **stats,
               "meets_goal": byte_ratio >= 1.25 and math.exp((nll - sum(base)) / tokens) <= 1.02,
               "units_list": units if len(units) < 40 else None}
        rows.append(row)
        print(f"[{time.perf_counter() - start_time:6.1f}s] {name:>52}: bytes x{byte_ratio:5.3f} fewer, "
              f"ppl x{row['ppl_ratio']:6.3f} (merged cos {stats['merged_tokens_mean_cos'] or 0:+.3f}) "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)

    result = {"model": "SmolLM2-135M-Instruct (fp32, CPU, HF eager)", "t": T_SLERP,
              "prefix_tokens": a.prefix, "continuation_tokens": a.continuation,
              "passages": [{k: d[k] for k in ("id", "source", "offset")} for d in docs],
              "calibration_passages": a.calibration, "identity_max_abs_logprob_diff": max(identity),
              "similarity": sim, "calibration_mean_cos": {k: v.tolist() for k, v in calib_mean.items()},
              "variants": rows, "plot": "similarity.png" if plotted else None,
              "argv": argv, "threads": a.threads, "elapsed_s": time.perf_counter() - start_time,
              "cpu_s": time.process_time()}
    (out / "minicache.json").write_text(json.dumps(result, indent=1))
    (out / "minicache.md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    lines = [f"# MiniCache on {r['model']}", "",
             f"{len(r['passages']) - r['calibration_passages']} passages of {r['prefix_tokens']} + "
             f"{r['continuation_tokens']} tokens (KJV / Shakespeare), t = {r['t']}; heads of the "
             f"head-selected rows chosen on {r['calibration_passages']} other passages. Perplexity "
             f"ratio: against the same bits unmerged, pooled over passages (per-passage range in "
             f"brackets). Bytes: the prefix's KV, unmerged / merged. Identity check: "
             f"{r['identity_max_abs_logprob_diff']:.2g} nats.", "",
             "| variant | (pair, head, K/V) planes merged | bytes (x fewer) | ppl | ppl ratio | per passage | "
             "cos of merged tokens | restore rel. error | goal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in r["variants"]:
        cos = v["merged_tokens_mean_cos"]
        err = v["merged_tokens_rel_error"]
        lines.append(
            f"| {v['name']} | {v['units']} | {v['bytes_ratio']:.3f} | {v['ppl']:.3f} | "
            f"{v['ppl_ratio']:.3f} | {min(v['per_doc_ppl_ratio']):.3f}-{max(v['per_doc_ppl_ratio']):.3f} | "
            f"{'' if cos is None else f'{cos:+.3f}'} | {'' if err is None else f'{err:.3f}'} | "
            f"{('yes' if v['meets_goal'] else 'no') if v['units'] else '-'} |")
    lines += ["", "Similarity, all passages: the cosine of a token's state in layers l and l+1, "
              "per KV head; rows group four pairs. Mean: over heads (the lowest..highest head); "
              "best pairing: the highest mean cosine of any head of l against any head of l+1; "
              "> 0.9: the largest share of tokens of one head above 0.9.", "",
              "| pairs | keys: mean (heads) | keys: best pairing | keys: > 0.9 | values: mean (heads) "
              "| values: best pairing | values: > 0.9 |", "|---|---|---|---|---|---|---|"]
    s = r["similarity"]
    n = len(s["k"]["mean"])
    for lo in range(0, n, 4):
        hi = min(n, lo + 4)
        cells = []
        for kind in ("k", "v"):
            m = [x for row in s[kind]["mean"][lo:hi] for x in row]
            b = [max(row) for row in s[kind]["best_head_mean"][lo:hi]]
            share = [x for row in s[kind]["share_above_0.9"][lo:hi] for x in row]
            cells += [f"{sum(m) / len(m):+.3f} ({min(m):+.3f}..{max(m):+.3f})", f"{max(b):+.3f}",
                      f"{max(share):.2%}"]
        lines.append(f"| {lo}-{lo + 1} .. {hi - 1}-{hi} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
