"""Selection rules of the persistent prefill selection (graphs/selection.py).

Each rule is checked against a plain definition, and the prefill wiring is checked on a tiny
random Llama: the scores it computes are the rule's, the recent window it passes is the
configured one, and the cache holds exactly the keys the scores select.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from minikv_compile import MiniKVConfig, minikv_compile
from minikv_compile import ops as ops_module
from minikv_compile.graphs import budget
from minikv_compile.graphs import prefill as prefill_module
from minikv_compile.graphs.runtime import Request
from minikv_compile.graphs.selection import (block_scores, mean_attention_scores, rank_union_scores,
                                             select_tokens, snapkv_scores, token_scores)

NEW_RULES = ("h2o_mean", "snapkv_h2o")


def _attention(q, k, scale):
    """Plain causal attention probabilities, fp64: q (H_q, L, D), k (H_kv, L, D) -> (H_q, L, L)."""
    g = q.shape[0] // k.shape[0]
    logits = torch.einsum("hld,hmd->hlm", q.double(), k.double().repeat_interleave(g, 0)) * scale
    L = q.shape[1]
    logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1)


def _qk(L=37, Hq=6, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, Hq, L, D, generator=g), torch.randn(1, Hkv, L, D, generator=g)


def test_mean_attention_is_the_average_over_the_queries_that_see_each_key():
    q, k = _qk()
    P = _attention(q[0], k[0], 0.25)  # (H_q, L, L)
    Hq, L, _ = P.shape
    g = Hq // k.shape[1]
    cumulative = P.view(k.shape[1], g, L, L).sum(dim=(1, 2))  # column sums per KV head
    got = mean_attention_scores(cumulative.float())
    for h in range(k.shape[1]):
        for t in range(L):
            seen = [P[i, r, t] for i in range(h * g, (h + 1) * g) for r in range(t, L)]
            assert math.isclose(got[h, t].item() / g, sum(seen).item() / len(seen), rel_tol=1e-5)


def _plain_rank_union(a, b, n):
    """Positions ordered by their better rank in a or b (ties: a's rank first), then position."""
    def ranks(x):
        order = sorted(range(n), key=lambda i: (-x[i], i))
        return {pos: r for r, pos in enumerate(order)}

    ra, rb = ranks(a), ranks(b)
    return sorted(range(n), key=lambda i: (min(ra[i], rb[i]), ra[i] > rb[i]))


@pytest.mark.parametrize("L, n", [(50, 50), (50, 31), (7, 1), (64, 48)])
def test_rank_union_matches_a_plain_ordering_and_holds_both_top_halves(L, n):
    g = torch.Generator().manual_seed(L + n)
    a, b = torch.rand(3, L, generator=g), torch.rand(3, L, generator=g)
    scores = rank_union_scores(a, b, n)
    assert torch.isinf(scores[:, n:]).all() and (scores[:, n:] < 0).all()
    for h in range(3):
        order = scores[h, :n].argsort(descending=True).tolist()
        assert order == _plain_rank_union(a[h].tolist(), b[h].tolist(), n)
        assert len(set(scores[h, :n].tolist())) == n  # no ties: the same choice on every device
        for m in range(1, n // 2 + 1):
            picked = set(scores[h, :n].topk(2 * m).indices.tolist())
            assert set(a[h, :n].topk(m).indices.tolist()) <= picked
            assert set(b[h, :n].topk(m).indices.tolist()) <= picked


def test_rank_union_of_one_ranking_with_itself_is_that_ranking():
    a = torch.rand(2, 40, generator=torch.Generator().manual_seed(3))
    scores = rank_union_scores(a, a.clone(), 40)
    assert torch.equal(scores.argsort(dim=-1, descending=True), a.argsort(dim=-1, descending=True))


def test_rank_union_with_no_candidates():
    assert torch.isinf(rank_union_scores(torch.rand(2, 5), torch.rand(2, 5), 0)).all()


@pytest.mark.parametrize("L, n, block", [(50, 45, 16), (64, 64, 16), (20, 20, 1), (9, 3, 4)])
def test_block_scores_take_whole_blocks_best_first(L, n, block):
    scores = torch.rand(2, L, generator=torch.Generator().manual_seed(L + block))
    got = block_scores(scores, block, n)
    assert torch.isinf(got[:, n:]).all()
    assert all(len(set(row.tolist())) == n for row in got[:, :n])
    blocks = [list(range(j, min(j + block, n))) for j in range(0, n, block)]
    for h in range(2):
        ranked = sorted(blocks, key=lambda b: (-max(scores[h, b].tolist()), b[0]))
        expected = [p for b in ranked for p in b]  # whole blocks, best first, in position order
        assert got[h, :n].argsort(descending=True).tolist() == expected


def test_token_scores_dispatch_and_sinks():
    q, k = _qk(L=40)
    cumulative = torch.rand(1, 2, 40, generator=torch.Generator().manual_seed(1))
    def cfg(**kw):  # the paper's settings unless the case says otherwise (defaults block + sink)
        return MiniKVConfig(**{**dict(snapkv_kernel=7, selection_block=1, sink_tokens=0), **kw})

    h2o = token_scores(cfg(selection="h2o"), q, k, cumulative, 0.25, 10)
    assert torch.equal(h2o, cumulative[0])  # the paper's rule, untouched
    assert torch.equal(token_scores(cfg(selection="h2o_mean"), q, k, cumulative, 0.25, 10),
                       mean_attention_scores(cumulative[0]))
    snap = snapkv_scores(q, k, 0.25, 32, 7)
    assert torch.equal(token_scores(cfg(selection="snapkv"), q, k, cumulative, 0.25, 10), snap)
    assert torch.equal(token_scores(cfg(selection="snapkv_h2o"), q, k, cumulative, 0.25, 10),
                       rank_union_scores(snap, cumulative[0], 30))
    # snapkv reads no cumulative scores (its prefill computes none); the others refuse None
    assert torch.equal(token_scores(cfg(selection="snapkv"), q, k, None, 0.25, 10), snap)
    for rule in ("h2o", "h2o_mean", "snapkv_h2o"):
        with pytest.raises(ValueError, match=f"cumulative: rule '{rule}' needs"):
            token_scores(cfg(selection=rule), q, k, None, 0.25, 10)
    sunk = token_scores(cfg(selection="h2o", sink_tokens=4), q, k, cumulative, 0.25, 10)
    assert torch.isinf(sunk[:, :4]).all() and torch.equal(sunk[:, 4:], cumulative[0, :, 4:])
    assert torch.equal(cumulative[0, :, :4], cumulative[0, :, :4].clone())  # input not mutated
    assert (select_tokens(sunk, 10, 6)[:, :4] == torch.arange(4)).all()
    assert torch.isinf(token_scores(cfg(sink_tokens=99), q, k, cumulative, 0.25, 10)).all()
    blocked = token_scores(cfg(selection="snapkv", selection_block=16, sink_tokens=2), q, k, cumulative,
                           0.25, 10)
    expected = block_scores(snap, 16, 30)
    expected[:, :2] = float("inf")
    assert torch.equal(blocked, expected)


@pytest.mark.parametrize("bad, match", [(dict(selection="oracle"), "selection"),
                                        (dict(sink_tokens=-1), "sink_tokens"),
                                        (dict(sink_tokens=2.0), "sink_tokens"),
                                        (dict(selection_block=0), "selection_block")])
def test_invalid_selection_config(bad, match):
    with pytest.raises(ValueError, match=match):
        MiniKVConfig(**bad)


def _tiny_llama():
    # SmolLM2-135M: 30 layers, 9 / 3 heads of 64; here 2 layers, 4 / 2 heads of 32.
    cfg = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, initializer_range=0.1)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None  # exactly the tokens asked for
    return model


@pytest.mark.parametrize("over", [dict(selection="h2o_mean"), dict(selection="snapkv_h2o"),
                                  dict(selection="snapkv_h2o", sink_tokens=4),
                                  dict(selection="h2o", sink_tokens=4),
                                  dict(selection="snapkv_h2o", budget_policy="pyramid"),
                                  dict(selection="snapkv", selection_block=16),
                                  dict(selection="h2o", selection_block=16, budget_policy="pyramid")])
def test_prefill_keeps_what_the_rule_selects(monkeypatch, over):
    calls = []

    def spy(config, q, k, cumulative, scale, n_recent):
        scores = token_scores(config, q, k, cumulative, scale, n_recent)
        calls.append(dict(k=k.clone(), scores=scores.clone(), n_recent=n_recent))
        return scores

    monkeypatch.setattr(prefill_module, "token_scores", spy)
    model = _tiny_llama()
    paper = dict(snapkv_kernel=7, selection_block=1, sink_tokens=0, kept_floor=1)
    config = MiniKVConfig(**{**paper, **dict(bits=16, heavy_budget=0.2, recent_budget=0.15,
                                             residual_length=32, max_prompt_len=128,
                                             max_new_tokens=24, snapkv_window=8), **over})
    cm = minikv_compile(model, config)
    prompt = torch.randint(0, 101, (97,), generator=torch.Generator().manual_seed(5)).tolist()
    cm.generate([prompt], max_new_tokens=1)  # prefill only: the cache holds the selection
    assert len(calls) == 2
    # generate() releases its slots, which empties them: look at the cache through admit
    cm.runtime.admit(0, Request(prompt, 1))
    for layer, (call, lc) in enumerate(zip(calls[2:], cm.runtime.cache.layers)):
        n_recent, n_heavy = budget.kept_tokens(config, 97, layer, 2)
        assert call["n_recent"] == n_recent
        idx = select_tokens(call["scores"], n_recent, n_heavy)  # (H_kv, n)
        expected = call["k"][0].gather(1, idx[..., None].expand(-1, -1, 32))
        n_quant, n_ring = lc.lens[0].tolist()
        held = torch.cat([lc.k_cache[0, :, :n_quant], lc.k_ring[0, :, :n_ring]], dim=1)
        assert torch.equal(held, expected)
        if config.sink_tokens:
            assert (idx[:, :config.sink_tokens] == torch.arange(config.sink_tokens)).all()
        if config.selection_block > 1:  # heavy hitters: whole aligned blocks, at most one in part
            heavy = idx[:, :n_heavy]
            for row in heavy.tolist():
                per_block = {}
                for pos in row:
                    per_block[pos // 16] = per_block.get(pos // 16, 0) + 1
                partial = [b for b, c in per_block.items() if c < min(16, 97 - n_recent - 16 * b)]
                assert len(partial) <= 1
    # and decoding from that selection runs through ring flushes
    cm.runtime.release(0)
    out = cm.generate([prompt], max_new_tokens=24).sequences[0]
    assert len(out) == 24


@pytest.mark.parametrize("rule, selective", [("snapkv", False), ("h2o", True),
                                             ("h2o_mean", True), ("snapkv_h2o", True)])
def test_prefill_computes_cumulative_scores_only_for_the_rules_that_read_them(monkeypatch, rule,
                                                                            selective):
    """Selective attention (its second pass sums every query's attention) runs in a layer that
    evicts under h2o-type rules only; snapkv's prefill runs ``causal_attention`` (SDPA on the
    CPU) and gets the same output (to fp32 rounding), so the same tokens are generated."""
    calls, selective_attention = [], ops_module.selective_attention

    def spy(q, k, v, scale=None):
        calls.append(q.shape[2])
        return selective_attention(q, k, v, scale=scale)

    monkeypatch.setattr(prefill_module.ops, "selective_attention", spy)
    model = _tiny_llama()
    config = MiniKVConfig(bits=16, heavy_budget=0.2, recent_budget=0.15, residual_length=32,
                          max_prompt_len=128, max_new_tokens=8, snapkv_window=8, selection=rule,
                          kept_floor=1)
    cm = minikv_compile(model, config)
    prompt = torch.randint(0, 101, (97,), generator=torch.Generator().manual_seed(5)).tolist()
    got = cm.generate([prompt], max_new_tokens=8).sequences[0]
    assert calls == ([97, 97] if selective else [])  # one call a layer of the 2, or none
    if not selective:  # the same selection and tokens with selective attention's output
        monkeypatch.setattr(prefill_module, "CUMULATIVE_RULES", ("snapkv",))
        assert cm.generate([prompt], max_new_tokens=8).sequences[0] == got
        assert calls == [97, 97]
