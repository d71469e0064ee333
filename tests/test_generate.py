"""generate() as HF users call it: HF's arguments, defaults, outputs, streamers, stopping
criteria; one model shared by threads; grad and inference modes. CPU, fp32, tiny random models,
compared with HF's own ``generate`` on the same model."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import BatchEncoding, GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from minikv_compile import minikv_compile
from minikv_compile.inputs import FP32_MAX, MIN_PENALTY, MIN_TEMPERATURE
from configs import snapkv
from test_engine import FULL, prompt_of, tiny

CFG = dict(**FULL, residual_length=32, max_prompt_len=64, max_new_tokens=24, max_batch_size=4)


def padded(prompts, side="left", pad=0):
    """A tokenizer's batch: ids padded to one width and the 0/1 mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        sl = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = torch.tensor(p), 1
    return BatchEncoding({"input_ids": ids, "attention_mask": mask})


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def cm(model):
    return minikv_compile(model, snapkv(**CFG))


def hf(model, enc, **kw):
    return model.generate(**enc, do_sample=False, pad_token_id=0, **kw)


def test_hf_calls_return_what_hf_returns(model, cm):
    enc = padded([prompt_of(20, 1), prompt_of(33, 2), prompt_of(7, 3)])
    want = hf(model, enc, max_new_tokens=12)
    # **tokenizer(...) style, HF's tensor output: the padded input followed by the new tokens
    got = cm.generate(**enc, max_new_tokens=12, pad_token_id=0, return_dict_in_generate=False)
    assert torch.equal(got, want)
    # a BatchEncoding passed positionally, HF's output class
    out = cm.generate(enc, max_new_tokens=12, pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput) and torch.equal(out.sequences, want)
    n = enc["input_ids"].shape[1]
    assert out.sequences[:, n:].tolist() == cm.generate(enc, max_new_tokens=12).sequences
    # max_length counts the (padded) input, as HF counts it
    assert torch.equal(cm.generate(**enc, max_length=n + 12, pad_token_id=0,
                                   return_dict_in_generate=False), want)
    # numpy ids, a 1-D prompt, a GenerationConfig
    one = prompt_of(20, 1)
    assert cm.generate(np.array(one), max_new_tokens=5).sequences[0] == want[0, n:n + 5].tolist()
    assert cm.generate(torch.tensor(one), generation_config=GenerationConfig(max_new_tokens=5)
                       ).sequences[0] == want[0, n:n + 5].tolist()


def test_defaults_come_from_the_models_generation_config_and_the_engine(model):
    small = minikv_compile(model, snapkv(**{**CFG, "max_new_tokens": 16}))
    p = [prompt_of(30, 4)]
    free = small.generate(p).sequences[0]            # no length anywhere: the engine's 16
    assert len(free) == 16
    eos = free[5]
    model.generation_config.eos_token_id = eos       # the model's eos stops it, as HF
    try:
        out = small.generate(p)
        assert out.sequences[0] == free[: free.index(eos) + 1] and out.stop_reasons == ["eos"]
        ids = torch.tensor(p)
        assert torch.equal(small.generate(ids, return_dict_in_generate=False),
                           model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=16, do_sample=False))
        assert small.generate(p, eos_token_id=[]).sequences[0] == free  # eos off for one call
        # min_new_tokens bans the eos until then, as HF's processor does
        forced = small.generate(p, min_new_tokens=10).sequences[0]
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              min_new_tokens=10, do_sample=False)[0, 30:].tolist()
        assert forced == want and eos not in forced[:10]
    finally:
        model.generation_config.eos_token_id = None


def test_repetition_penalty_matches_hf_greedy(model, cm):
    p = prompt_of(40, 6)
    ids = torch.tensor([p])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                          do_sample=False, repetition_penalty=1.7)[0, 40:].tolist()
    got = cm.generate([p], max_new_tokens=20, repetition_penalty=1.7).sequences[0]
    assert got == want and got != cm.generate([p], max_new_tokens=20).sequences[0]


@pytest.mark.parametrize("penalty", [MIN_PENALTY, FP32_MAX], ids=["lowest", "highest"])
def test_the_extreme_accepted_penalties_run_as_hf(model, cm, penalty):
    """The ends of the accepted range run in the fp32 sampling step (no overflow, no NaN) and
    choose what HF chooses; one step beyond each is refused before any work."""
    p = prompt_of(40, 6)
    ids = torch.tensor([p])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                          do_sample=False, repetition_penalty=penalty)[0, 40:].tolist()
    assert cm.generate([p], max_new_tokens=12, repetition_penalty=penalty).sequences[0] == want
    sampled = cm.generate([p], max_new_tokens=12, repetition_penalty=penalty, do_sample=True,
                          temperature=MIN_TEMPERATURE, seed=3).sequences[0]
    assert len(sampled) == 12 and all(0 <= t < model.config.vocab_size for t in sampled)
    beyond = penalty / 10 if penalty == MIN_PENALTY else penalty * 10
    with pytest.raises(ValueError, match="repetition_penalty: expected a finite number in"):
        cm.generate([p], max_new_tokens=12, repetition_penalty=beyond)


class _StopOn(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_stopping_criteria_and_streamers_as_hf(model, cm):
    p = prompt_of(25, 7)
    ids = torch.tensor([p])
    free = cm.generate([p], max_new_tokens=20).sequences[0]
    stop = StoppingCriteriaList([_StopOn(free[6])])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                          do_sample=False, stopping_criteria=stop)
    out = cm.generate([p], max_new_tokens=20, stopping_criteria=stop)
    assert out.sequences[0] == want[0, 25:].tolist() and out.stop_reasons == ["stop"]
    mine, theirs = _Recorder(), _Recorder()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                   streamer=theirs)
    cm.generate(ids, max_new_tokens=8, streamer=mine)
    assert mine.puts == theirs.puts and mine.ended and theirs.ended


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_beams=2), NotImplementedError, "num_beams=2"),
    (dict(penalty_alpha=0.6, top_k=4), NotImplementedError, "penalty_alpha"),
    (dict(num_return_sequences=2), NotImplementedError, "num_return_sequences"),
    (dict(output_scores=True), NotImplementedError, "output_scores"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
    (dict(streamer=object()), ValueError, "streamer: expected an object with put"),
    (dict(stopping_criteria=3), ValueError, "stopping_criteria: expected a callable"),
    (dict(generation_config={"max_new_tokens": 3}), ValueError, "generation_config: expected"),
    (dict(max_length=10), ValueError, "max_length: expected more than the input length 30"),
    (dict(max_new_tokens=25), ValueError, "max_new_tokens: expected 1..24"),
    (dict(eos_check_every=0), ValueError, "eos_check_every"),
    (dict(do_sample="yes"), ValueError, "do_sample"),
    (dict(top_k=True, do_sample=True), ValueError, "top_k"),
    (dict(eos_token_id=True), ValueError, "eos_token_id"),
    (dict(eos_token_id=101), ValueError, "eos_token_id"),
    (dict(temperature=1e-38, do_sample=True), ValueError, "temperature"),
    # floats beyond what the fp32 sampling step holds: a ValueError, not a RuntimeError mid-run
    (dict(repetition_penalty=1e39), ValueError, r"repetition_penalty: expected a finite number "
                                                r"in \[1e-30, 3.4"),
    (dict(repetition_penalty=1e-31), ValueError, "repetition_penalty"),
    (dict(temperature=1e39, do_sample=True), ValueError, "temperature: .* that float32 holds"),
    (dict(top_p=1e-40, do_sample=True), ValueError, "top_p: .* that float32 holds"),
])
def test_unsupported_and_bad_arguments_fail_before_any_work(cm, kwargs, error, match):
    replays, compiles = cm.stats["replays"], cm.stats["compiles"]
    with pytest.raises(error, match=match):
        cm.generate([prompt_of(30)], **kwargs)
    assert cm.runtime.admitted == [] and (cm.stats["replays"], cm.stats["compiles"]) == (
        replays, compiles)


class _OneForAll(StoppingCriteria):
    """One flag for the whole batch (HF broadcasts it): stop once every row has ``n`` tokens."""

    def __init__(self, width):
        self.width = width

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([input_ids.shape[1] >= self.width])


def test_a_one_element_stopping_result_is_broadcast_and_other_lengths_refused(model, cm):
    prompts = torch.tensor([prompt_of(20, 1), prompt_of(20, 2), prompt_of(20, 3)])
    mask = torch.ones_like(prompts)
    stop = StoppingCriteriaList([_OneForAll(20 + 5)])
    want = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          stopping_criteria=stop)
    got = cm.generate(prompts, attention_mask=mask, max_new_tokens=12, stopping_criteria=stop,
                      return_dict_in_generate=False)
    assert torch.equal(got, want) and got.shape[1] <= 20 + 5
    assert cm.generate(prompts, max_new_tokens=12,
                       stopping_criteria=lambda ids, scores: True).decode_steps < 11
    free = cm.generate(prompts, max_new_tokens=12).sequences
    for wrong, match in [
            (lambda ids, scores: torch.ones(2, dtype=torch.bool), r"shape \(3,\) .* got shape \(2,\)"),
            (lambda ids, scores: torch.ones(3, 1, dtype=torch.bool), r"got shape \(3, 1\)"),
            (lambda ids, scores: torch.ones(3), "expected a \\(B,\\) bool tensor"),
            (lambda ids, scores: torch.full((3,), 2), r"bool flags \(or 0 / 1\), got values \[2\]"),
            (lambda ids, scores: "yes", "expected a \\(B,\\) bool tensor .* got str")]:
        with pytest.raises(ValueError, match="stopping_criteria: .*" + match):
            cm.generate(prompts, max_new_tokens=12, stopping_criteria=wrong)
        assert cm.runtime.admitted == []
    assert cm.generate(prompts, max_new_tokens=12).sequences == free  # the engine goes on


def test_bad_ids_and_masks(cm):
    ids = torch.tensor([prompt_of(10), prompt_of(10, 1)])
    for bad, match in [
        (dict(inputs=ids.float()), "input_ids"),
        (dict(inputs="hello"), "tokenize the text first"),
        (dict(inputs=[[1, "2"]]), r"input_ids\[0\]\[1\]"),
        (dict(inputs=ids, attention_mask=torch.full_like(ids, 2)), "attention_mask"),
        (dict(inputs=ids, attention_mask=torch.full(ids.shape, 0.5)), "attention_mask"),
        (dict(inputs=[[1, 2**70]]), "input_ids"),
        (dict(inputs=ids, input_ids=ids), "got both"),
        (dict(inputs=torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]]), pad_token_id=0),
         "attention_mask"),  # a padded batch without its mask is refused, never guessed
    ]:
        with pytest.raises(ValueError, match=match):
            cm.generate(**bad, max_new_tokens=4)
    # 1-D ids with a 1-D mask, and a 0-d tensor count
    one = torch.tensor(prompt_of(10))
    assert cm.generate(one, attention_mask=torch.ones(10, dtype=torch.int64),
                       max_new_tokens=torch.tensor(4)).sequences == \
        cm.generate([prompt_of(10)], max_new_tokens=4).sequences


def test_teacher_force_empty_target_says_so(cm):
    with pytest.raises(ValueError, match="targets: expected at least one token"):
        cm.teacher_force([prompt_of(10)], [[]])


def test_threads_sharing_a_model_get_their_own_tokens(model):
    cm = minikv_compile(model, snapkv(**CFG))
    prompts = [prompt_of(20 + 7 * i, seed=i) for i in range(2)]
    want = [cm.generate([p], max_new_tokens=24).sequences[0] for p in prompts]
    got, errors = [[], []], []

    def worker(i):
        try:
            for _ in range(6):
                got[i].append(cm.generate([prompts[i]], max_new_tokens=24).sequences[0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(g == [w] * 6 for g, w in zip(got, want))


def test_built_and_called_under_any_grad_mode(model):
    p = [prompt_of(30)]
    with torch.inference_mode():
        cm = minikv_compile(model, snapkv(**CFG, compile=True))
        first = cm.generate(p, max_new_tokens=10).sequences
    assert cm.generate(p, max_new_tokens=10).sequences == first      # outside inference mode
    with torch.no_grad():
        assert cm.generate(p, max_new_tokens=10).sequences == first
    with torch.enable_grad():
        assert cm.generate(p, max_new_tokens=10).sequences == first
    # the start, the layer and the choice: no recompile
    assert cm.stats["compiles"] == 3


def test_kv_memory_compares_like_with_like(model):
    cm = minikv_compile(model, snapkv(**{**CFG, "bits": 2, "heavy_budget": 0.25,
                                               "recent_budget": 0.25, "kept_floor": 1}))
    rep = cm.kv_memory(prompt_len=30, new_tokens=10, batch=1)
    # 2 layers, 2 KV heads x 64: an uncompressed fp32 cache of 1 x (30 + 10) tokens
    assert rep.full_dtype == torch.float32 and rep.full_bytes == 2 * 2 * 128 * 40 * 4
    assert rep.fp16_bytes == rep.full_bytes // 2
    # 15 kept + 10 new = 25 tokens, 32 held (two groups of 16) at 2 bits + fp16 scale and zero
    per_layer = 2 * 128 * 32 * (2 / 8 + 4 / 16)
    assert rep.quantized_region_bytes == 2 * per_layer
    assert rep.total_bytes == rep.quantized_region_bytes + rep.ring_bytes + 2 * 2 * 4
    assert rep.ratio == rep.total_bytes / rep.full_bytes
    assert rep.allocated_bytes > rep.total_bytes  # 4 slots at full capacity
    assert "uncompressed float32" in str(rep)
    with pytest.raises(ValueError, match="prompt_len"):
        cm.kv_memory(prompt_len=65)


def test_what_a_generation_config_says_and_a_calls_none_count_as_in_hf(model, cm):
    p = prompt_of(10, 4)
    free = cm.generate([p], max_new_tokens=12).sequences[0]
    ids = torch.tensor([p])
    # return_dict_in_generate from a GenerationConfig (the call's, or the model's)
    out = cm.generate([p], generation_config=GenerationConfig(return_dict_in_generate=True,
                                                              max_new_tokens=3))
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.sequences[0, 10:].tolist() == free[:3]
    # eos_token_id=None in the call: no eos, as HF (the model's would stop at the 4th token)
    model.generation_config.eos_token_id = free[3]
    try:
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False, eos_token_id=None)
        got = cm.generate([p], max_new_tokens=12, eos_token_id=None)
        assert got.sequences[0] == want[0, 10:].tolist() == free
        assert cm.generate([p], max_new_tokens=12).sequences[0] == free[:4]
        model.generation_config.return_dict_in_generate = True
        assert isinstance(cm.generate([p], max_new_tokens=2), GenerateDecoderOnlyOutput)
    finally:
        model.generation_config.eos_token_id = None
        model.generation_config.return_dict_in_generate = False


def test_max_length_counts_a_list_of_tensors_rows_and_method_names_are_no_arguments(cm):
    rows = [torch.tensor(prompt_of(10, 1)), torch.tensor(prompt_of(10, 2))]
    out = cm.generate(rows, max_length=13)
    assert [len(s) for s in out.sequences] == [3, 3]  # 13 less the rows' 10, not less 2 rows
    assert [len(s) for s in cm.generate([r.numpy() for r in rows], max_length=13).sequences] \
        == [3, 3]
    for name in ("to_dict", "validate", "update"):
        with pytest.raises(TypeError, match=rf"unexpected keyword argument\(s\) \['{name}'\]"):
            cm.generate(rows, max_new_tokens=2, **{name: 1})


def test_prompts_of_different_lengths_without_a_pad_id_are_refused_before_any_work(cm):
    prompts = [prompt_of(10, 1), prompt_of(7, 2)]
    steps = []
    with pytest.raises(ValueError, match=r"pad_token_id: expected an id to pad prompts of "
                                         r"different lengths into one tensor, got None"):
        cm.generate(prompts, max_new_tokens=4, return_dict_in_generate=False,
                    streamer=steps.append)
    assert steps == [] and cm.runtime.admitted == []
    assert [len(s) for s in cm.generate(prompts, max_new_tokens=4).sequences] == [4, 4]


def test_a_failed_call_still_ends_an_hf_streamer(cm):
    """A consumer iterating an HF streamer (TextIteratorStreamer's) is not left waiting when
    the call fails: ``end()`` runs, then the error is raised; the engine goes on."""
    class Breaks(_Recorder):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 3:
                raise RuntimeError("the consumer went away")

    p = prompt_of(12, 5)
    free = cm.generate([p], max_new_tokens=8).sequences
    streamer = Breaks()
    with pytest.raises(RuntimeError, match="the consumer went away"):
        cm.generate([p], max_new_tokens=8, streamer=streamer)
    assert streamer.ended and cm.runtime.admitted == []
    assert cm.generate([p], max_new_tokens=8).sequences == free
