"""The accuracy harness's two modes (issue 46, "Question-agnostic accuracy"): question last (the
whole prompt compressed at once) and context first (the document cached by ``cache_prompt``
before the question, the question prefilled through that cache).

One run of three methods in both modes on the random tiny Llama over byte tokens (the harness's
CPU plumbing model), shared by every test below; its prose is a few stdlib modules' docstrings,
so nothing is downloaded and no corpus is parsed.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import subprocess
import tarfile
from dataclasses import replace

import pytest
import torch

from minikv_compile import MiniKVConfig
from minikv_compile.engine import MiniKVModel
from minikv_compile.perf.accuracy import __main__ as cli
from minikv_compile.perf.accuracy import methods, reporting, running, tasks

# full: bits 16, nothing evicted. snapkv_block_sink: 25% + 25% kept at 2 bits (kept_floor 1, so
# the tiny prompts are evicted) by SnapKV, whose ranking reads the prompt's last 32 queries,
# which context-first mode moves after compression.
METHOD_NAMES = ("full", "snapkv_block_sink")
PLAN = replace(tasks.PLANS["quick"], needle_lengths=(320,), needle_depths=(0.3, 0.7),
               needle_per_cell=1, needle_new_tokens=8, ppl_docs=2, ppl_prefix=256,
               ppl_continuation=24, hf_check=0)


def _corpora() -> tasks.Corpora:
    prose = "\n\n".join(m.__doc__ for m in (argparse, collections, json, subprocess, tarfile))
    return tasks.Corpora(prose=(("stdlib docstrings", prose),), code=())


@pytest.fixture(scope="module")
def subject():
    return running.Subject("tiny", running.tiny_llama(torch.float32, "cpu"), tasks.ByteCodec(),
                           _corpora(), {"model": "random tiny Llama, byte tokens"})


@pytest.fixture(scope="module")
def samples(subject):
    return tasks.build_samples(subject.codec, subject.corpora, PLAN, ("needle", "ppl"))


def _run(subject, samples, out, names, modes=running.MODES):
    run = running.Run("quick", subject, PLAN, [methods.METHODS[n] for n in names], samples, out,
                      torch.device("cpu"), torch.float32, compile=False, cuda_graphs=False,
                      budget_s=None, argv=["test"], modes=modes)
    run.run()
    return run


@pytest.fixture(scope="module")
def both(subject, samples, tmp_path_factory):
    """The JSON and markdown of one run of ``METHOD_NAMES`` in both modes."""
    out = tmp_path_factory.mktemp("modes")
    _run(subject, samples, out, METHOD_NAMES)
    return json.loads((out / "quick.json").read_text()), (out / "quick.md").read_text(), out


def _rows(data, method, task, mode):
    units = [u for u in data["units"] if (u["method"], u["task"], u["mode"]) == (method, task, mode)]
    assert len(units) == 1, (method, task, mode)
    return {r["id"]: r for r in units[0]["rows"]}


def test_the_split_is_the_question_last_prompt_token_for_token(subject, samples):
    codec = subject.codec
    for s in samples["needle"]:
        doc, question = s["prompt"][:s["doc_len"]], s["prompt"][s["doc_len"]:]
        assert doc + question == s["prompt"] and len(s["prompt"]) == s["prompt_len"]
        # the document is the chat prefix and the haystack with the fact; the rest is exactly
        # the question and the assistant's header, nothing of the haystack
        assert doc[:len(codec.chat_prefix)] == codec.chat_prefix
        assert f"The secret code of the {s['key']} is {s['answer']}." in codec.decode(doc)
        assert question == codec.encode(f"\nWhat is the secret code of the {s['key']}? Answer with "
                                        "the number only.") + codec.chat_suffix
    for s in samples["ppl"]:
        assert s["doc_len"] == PLAN.ppl_prefix - tasks.CONTEXT_TAIL == len(s["prompt"]) - 32


def test_full_cache_gives_identical_results_in_both_modes(both):
    data, _, _ = both
    # bits=16, nothing evicted: the same greedy tokens, the same log-probabilities
    ql, cf = _rows(data, "full", "needle", "question-last"), _rows(data, "full", "needle", "context-first")
    assert ql.keys() == cf.keys() and len(ql) == 2
    for i in ql:
        assert cf[i]["tokens"] == ql[i]["tokens"] and len(ql[i]["tokens"]) == PLAN.needle_new_tokens
        assert cf[i]["score"] == ql[i]["score"]
    ql, cf = _rows(data, "full", "ppl", "question-last"), _rows(data, "full", "ppl", "context-first")
    for i in ql:
        assert cf[i]["nll"] == pytest.approx(ql[i]["nll"], rel=1e-6, abs=1e-6)
        assert cf[i]["logprobs_head"] == pytest.approx(ql[i]["logprobs_head"], abs=1e-6)
    contrast = data["mode_contrast"]["full"]
    assert contrast["needle"]["diff"] == 0.0 and contrast["ppl"]["ratio"] == pytest.approx(1.0, abs=1e-6)


def test_compressed_methods_carry_both_modes_and_compress_before_the_question(both, samples):
    data, _, _ = both
    assert data["modes"] == ["question-last", "context-first"] and data["finished"]
    keys = {(u["method"], u["task"], u["mode"]) for u in data["units"]}
    assert keys == {(m, t, mode) for m in METHOD_NAMES for t in ("needle", "ppl")
                    for mode in running.MODES}
    assert set(data["summary_by_mode"]) == set(running.MODES)
    assert data["summary"] == data["summary_by_mode"]["question-last"]
    for m in METHOD_NAMES:
        for mode in running.MODES:
            assert data["summary_by_mode"][mode][m]["tasks"]["ppl"]["n"] == 2
    L = {task: round(sum(s["prompt_len"] for s in ss) / len(ss)) for task, ss in samples.items()}
    D = {task: round(sum(s["doc_len"] for s in ss) / len(ss)) for task, ss in samples.items()}
    new = {"needle": PLAN.needle_new_tokens, "ppl": PLAN.ppl_continuation}
    for u in data["units"]:
        if u["mode"] != "context-first":
            continue
        config = MiniKVConfig(**u["config"])
        task = u["task"]
        # the document compressed, the tail counted as generated tokens (kept whole)
        assert u["kv"]["doc_len"] == D[task] and u["kv"]["tail_tokens"] == L[task] - D[task]
        assert u["kv"]["formula_bytes"] == methods.kv_bytes(config, 2, 32, D[task],
                                                            L[task] - D[task] + new[task], 16)
        assert all(r["cache_bytes"] > 0 for r in u["rows"])
    cache = {m: _rows(data, m, "ppl", "context-first")["ppl/0"]["cache_bytes"] for m in METHOD_NAMES}
    assert cache["snapkv_block_sink"] < cache["full"] / 1.5  # the fp32 ring of 64 rows aside
    # SnapKV ranks by the last 32 prompt queries: context first, they are the document's last,
    # not the prompt's, so another set of tokens is kept and the log-probabilities change
    ql, cf = _rows(data, "snapkv_block_sink", "ppl", "question-last"), _rows(
        data, "snapkv_block_sink", "ppl", "context-first")
    assert any(abs(cf[i]["nll"] - ql[i]["nll"]) > 1e-3 for i in ql)
    contrast = data["mode_contrast"]["snapkv_block_sink"]
    assert contrast["ppl"]["n"] == 2 and contrast["needle"]["n"] == 2
    nll = lambda mode: sum(r["nll"] for r in _rows(data, "snapkv_block_sink", "ppl", mode).values())  # noqa: E731
    assert contrast["ppl"]["ratio"] == pytest.approx(
        math.exp((nll("context-first") - nll("question-last")) / (2 * PLAN.ppl_continuation)))


def test_the_markdown_shows_both_modes_side_by_side(both):
    data, md, out = both
    assert "## Question last and context first" in md and "### Context first" in md
    assert "### Question last" in md
    header = next(line for line in md.splitlines() if line.startswith("| method | KV % question last"))
    assert "needle % context first" in header and "PPL ×full context first" in header
    for m in METHOD_NAMES:
        label = methods.METHODS[m].label
        side = [line for line in md.splitlines() if line.startswith(f"| {label} |")]
        # side by side (9 columns), then each mode's own table (10), then needle by length, depth
        assert [line.count(" | ") for line in side[:3]] == [8, 9, 9]
        cells = side[0].split(" | ")
        kv_ql = 100 * data["summary_by_mode"]["question-last"][m]["kv_fraction"]
        kv_cf = 100 * data["summary_by_mode"]["context-first"][m]["kv_fraction"]
        assert cells[1] == f"{kv_ql:.1f}" and cells[2] == f"{kv_cf:.1f}"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / reporting.PLOT_NAME).stat().st_size > 10_000


def test_a_method_that_cannot_cache_a_prompt_is_reported_not_dropped(subject, samples, tmp_path,
                                                                     monkeypatch):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError("cache_prompt: prompt caches with tensor_parallel=2")

    monkeypatch.setattr(MiniKVModel, "cache_prompt", refuse)
    run = _run(subject, {"ppl": samples["ppl"][:1]}, tmp_path, ("full",))
    data, md = run.data, (tmp_path / "quick.md").read_text()
    assert [u["mode"] for u in data["units"]] == ["question-last"] and data["finished"]
    assert data["unsupported"] == [{"method": "full", "mode": "context-first", "task": "ppl",
                                    "group": "ppl",
                                    "reason": "cache_prompt: prompt caches with tensor_parallel=2"}]
    row = next(line for line in md.splitlines() if line.startswith("| Full cache (16-bit) |"))
    assert "not supported" in row
    assert "- full ppl/ppl context-first: cache_prompt: prompt caches with tensor_parallel=2" in md


def test_mode_flag_and_question_last_default():
    assert cli.parse_args([]).mode == "question-last"
    assert cli.parse_args(["--mode", "both"]).mode == "both"
    with pytest.raises(SystemExit):
        cli.parse_args(["--mode", "question-first"])
    with pytest.raises(ValueError, match="modes: expected one or more of"):
        running.Run("quick", None, PLAN, [], {}, pathlib.Path("."), torch.device("cpu"),
                    torch.float32, False, False, None, [], modes=("sideways",))
