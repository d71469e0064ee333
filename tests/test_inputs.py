"""The boundary checks (issue 23): good arguments give exact values, bad ones "expected X, got Y"."""
import math

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

from minikv_compile.config import PRESETS, MiniKVConfig
from minikv_compile.inputs import (FP32_MAX, FP32_TINY, MIN_PENALTY, MIN_TEMPERATURE, SamplingParams,
                                   check_bool, check_float, check_int, eos_ids, sampling_params,
                                   token_rows)

V = 50  # vocab size of the checks below


# -- scalars -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, kw, want", [
    (8, {}, 8),
    (np.int64(8), dict(lo=1, hi=16), 8),
    (np.uint8(3), {}, 3),
    (np.array(5), {}, 5),
    (torch.tensor(7), dict(lo=7, hi=7), 7),
    (torch.tensor(7, dtype=torch.int32), {}, 7),
    (-3, dict(hi=0), -3),
    (2**70, {}, 2**70),
])
def test_check_int_accepts(value, kw, want):
    got = check_int("n", value, **kw)
    assert got == want and type(got) is int


@pytest.mark.parametrize("value, kw, match", [
    (True, {}, r"n: expected an int, got True \(bool\)"),
    (np.bool_(True), {}, r"n: expected an int, got"),
    (2.0, {}, r"n: expected an int, got 2\.0 \(float\)"),
    (np.float64(2.0), {}, r"n: expected an int, got"),
    (torch.tensor(2.0), {}, r"n: expected an int, got tensor\(2\.\) \(torch\.float32"),
    (torch.tensor(True), {}, r"n: expected an int, got"),
    (torch.tensor([3]), {}, r"n: expected an int, got"),
    ("8", {}, r"n: expected an int, got '8' \(str\)"),
    (None, {}, r"n: expected an int, got None"),
    (0, dict(lo=1), r"n: expected an int >= 1, got 0$"),
    (17, dict(lo=1, hi=16), r"n: expected an int in \[1, 16\], got 17$"),
    (np.int64(17), dict(lo=1, hi=16), r"n: expected an int in \[1, 16\], got np.int64\(17\)$"),
    (5, dict(hi=4), r"n: expected an int <= 4, got 5$"),
])
def test_check_int_refuses(value, kw, match):
    with pytest.raises(ValueError, match=match):
        check_int("n", value, **kw)


@pytest.mark.parametrize("value, kw, want", [
    (0.5, {}, 0.5),
    (2, {}, 2.0),
    (np.float32(0.25), {}, 0.25),
    (np.int64(3), {}, 3.0),
    (torch.tensor(0.5), {}, 0.5),
    (torch.tensor(1), dict(lo=0, hi=1), 1.0),
    (1.0, dict(lo=0, hi=1), 1.0),
    (0.0, dict(lo=0), 0.0),
])
def test_check_float_accepts(value, kw, want):
    got = check_float("x", value, **kw)
    assert got == want and type(got) is float


@pytest.mark.parametrize("value, kw, match", [
    ("1", {}, r"x: expected a finite number, got '1' \(str\)"),
    (True, {}, r"x: expected a finite number, got True \(bool\)"),
    (None, {}, r"x: expected a finite number, got None"),
    (math.nan, {}, r"x: expected a finite number, got nan"),
    (math.inf, {}, r"x: expected a finite number, got inf"),
    (10**400, {}, r"x: expected a finite number, got 1000"),
    (1 + 2j, {}, r"x: expected a finite number, got"),
    (torch.tensor([0.5]), {}, r"x: expected a finite number, got"),
    (0.0, dict(lo=0, lo_open=True), r"x: expected a finite number > 0, got 0\.0"),
    (1.0, dict(lo=0, hi=1, hi_open=True), r"x: expected a finite number in \[0, 1\), got 1\.0"),
    (0.0, dict(lo=0, hi=1, lo_open=True), r"x: expected a finite number in \(0, 1\], got 0\.0"),
    (1.5, dict(hi=1), r"x: expected a finite number <= 1, got 1\.5"),
])
def test_check_float_refuses(value, kw, match):
    with pytest.raises(ValueError, match=match):
        check_float("x", value, **kw)


@pytest.mark.parametrize("value, want", [
    (True, True), (False, False), (np.bool_(True), True), (torch.tensor(False), False),
    (np.array(True), True),
])
def test_check_bool_accepts(value, want):
    got = check_bool("do_sample", value)
    assert got is want


@pytest.mark.parametrize("value", ["yes", "True", 1, 0, 1.0, None, torch.tensor(1), np.int64(1)])
def test_check_bool_refuses(value):
    with pytest.raises(ValueError, match=r"do_sample: expected True or False, got"):
        check_bool("do_sample", value)


def test_eos_check_every_zero_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"eos_check_every: expected an int >= 1, got 0"):
        check_int("eos_check_every", 0, lo=1)


# -- prompts -----------------------------------------------------------------------------------


def _encoding(ids, mask=None):
    data = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
    return BatchEncoding(data)


@pytest.mark.parametrize("ids, mask, want", [
    (torch.tensor([[1, 2, 3], [4, 5, 6]]), None, [[1, 2, 3], [4, 5, 6]]),
    (torch.tensor([1, 2, 3]), None, [[1, 2, 3]]),
    (torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 1]), [[2, 3]]),  # 1-D ids, 1-D mask
    (np.array([[1, 2], [3, 4]]), None, [[1, 2], [3, 4]]),
    (np.array([[1, 2], [3, 4]], dtype=np.uint16), np.array([[1, 0], [1, 1]]), [[1], [3, 4]]),
    ([1, 2, 3], None, [[1, 2, 3]]),
    ((1, 2), None, [[1, 2]]),
    ([np.int64(4), torch.tensor(5)], None, [[4, 5]]),
    (list(torch.tensor([7, 8])), None, [[7, 8]]),  # 0-d tensor elements
    ([[1, 2, 3], [4]], None, [[1, 2, 3], [4]]),  # ragged, no mask
    ([torch.tensor([1, 2]), np.array([3])], None, [[1, 2], [3]]),
    # left padding, right padding and holes; masks as int, bool, numpy, lists
    (torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
     [[7, 8], [5, 6, 7, 8]]),
    (torch.tensor([[7, 8, 0, 0], [5, 6, 7, 8]]), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool),
     [[7, 8], [5, 6, 7, 8]]),
    (torch.tensor([[7, 0, 8, 9]]), [[1, 0, 1, 1]], [[7, 8, 9]]),  # list mask
    (torch.tensor([[7, 0, 8, 9]]), [[True, False, True, True]], [[7, 8, 9]]),
    ([[7, 0, 8], [1, 2, 3]], [[1, 0, 1], [1, 1, 1]], [[7, 8], [1, 2, 3]]),
    ([7, 0, 8], [1, 0, 1], [[7, 8]]),
    (torch.tensor([[1, 2, 3]]), torch.tensor([1, 1, 0]), [[1, 2]]),
    (torch.tensor([[0, 49]]), None, [[0, 49]]),  # both ends of the vocabulary
    # a BatchEncoding (apply_chat_template(..., return_tensors="pt") in transformers 5) or a dict,
    # passed positionally: its own mask applies
    (_encoding(torch.tensor([[0, 3, 4]]), torch.tensor([[0, 1, 1]])), None, [[3, 4]]),
    (_encoding(torch.tensor([[0, 3, 4]]), torch.tensor([[0, 1, 1]])), torch.tensor([[0, 1, 1]]), [[3, 4]]),
    (_encoding([[0, 3, 4]], [[0, 1, 1]]), None, [[3, 4]]),
    (_encoding(torch.tensor([[3, 4]])), None, [[3, 4]]),
    (_encoding(torch.tensor([[0, 3, 4]])), torch.tensor([[0, 1, 1]]), [[3, 4]]),
    ({"input_ids": [[3, 4], [5]]}, None, [[3, 4], [5]]),
])
def test_token_rows_accepts(ids, mask, want):
    got = token_rows(ids, mask, V)
    assert got == want
    assert all(type(t) is int for row in got for t in row)


@pytest.mark.parametrize("ids, mask, match", [
    # floats are never read as ids, 1.0 included
    (torch.tensor([[1.7, 2.0]]), None, r"input_ids: expected integer token ids, got dtype torch\.float32"),
    (torch.tensor([[1.0, 2.0]], dtype=torch.float64), None, r"input_ids: expected integer token ids"),
    ([1.7, 2], None, r"input_ids\[0\]: expected a token id \(int\), got 1\.7 \(float\)"),
    ([[1, 2.0]], None, r"input_ids\[0\]\[1\]: expected a token id \(int\), got 2\.0 \(float\)"),
    (np.array([[1.0, 2.0]]), None, r"input_ids: expected integer token ids, got dtype numpy float64"),
    # strings: a prompt must be tokenized first; numeric strings are not ids either
    ("Hello there", None, r"input_ids: expected token ids, got a string 'Hello there'; tokenize"),
    (["Hello", "there"], None,
     r"input_ids\[0\]: expected a token id \(int\), got a string 'Hello'; tokenize"),
    (["12", "7"], None, r"input_ids\[0\]: expected a token id \(int\), got a string '12'"),
    ([["1", "2"]], None, r"input_ids\[0\]\[0\]: expected a token id \(int\), got a string '1'"),
    (np.array(["1", "2"]), None, r"input_ids: expected integer token ids, got dtype numpy <U1; tokenize"),
    # bools
    ([True, 2], None, r"input_ids\[0\]: expected a token id \(int\), got True \(bool\)"),
    (torch.tensor([[True, False]]), None, r"input_ids: expected integer token ids, got dtype torch\.bool"),
    (np.array([True]), None, r"input_ids: expected integer token ids, got dtype numpy bool"),
    # out of range: negative, >= vocab, beyond int64
    ([[1, -1]], None, r"input_ids\[0\]\[1\]: expected a token id in \[0, 50\), got -1"),
    (torch.tensor([[1, 50]]), None, r"input_ids\[0\]\[1\]: expected a token id in \[0, 50\), got 50"),
    ([1, 2**63], None, r"input_ids\[0\]\[1\]: expected a token id in \[0, 50\), got 9223372036854775808"),
    ([[2**64]], None, r"input_ids\[0\]\[0\]: expected a token id in \[0, 50\), got 18446744073709551616"),
    (np.array([2**63], dtype=np.uint64), None, r"expected a token id in \[0, 50\), got 9223372036854775808"),
    # masked-out positions are not checked, kept ones are
    (torch.tensor([[60, 1]]), torch.tensor([[1, 1]]),
     r"input_ids\[0\]\[0\]: expected a token id in \[0, 50\)"),
    # empty batch / empty prompt
    ([], None, r"input_ids: expected at least one prompt, got none"),
    (torch.zeros(0, 4, dtype=torch.long), None, r"input_ids: expected at least one prompt"),
    (torch.zeros(2, 0, dtype=torch.long), None, r"input_ids\[0\]: expected at least one token, got none"),
    ([[1, 2], []], None, r"input_ids\[1\]: expected at least one token, got none"),
    (torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 1], [0, 0]]),
     r"input_ids\[1\]: expected at least one token after the attention_mask, got none"),
    # shapes and types
    (torch.tensor(3), None, r"input_ids: expected a 1-D \(L,\) or 2-D \(B, L\) array, got shape \(\)"),
    (torch.zeros(1, 2, 3, dtype=torch.long), None, r"input_ids: expected a 1-D \(L,\) or 2-D \(B, L\) array"),
    ([[1, 2], 3], None, r"input_ids\[1\]: expected a list of ints like the rows before it, got 3"),
    ([1, [2, 3]], None, r"input_ids\[1\]: expected a token id \(int\), got \[2, 3\] \(list\)"),
    ([[[1, 2]]], None, r"input_ids\[0\]\[0\]: expected a token id \(int\), got \[1, 2\]"),
    ({1, 2}, None, r"input_ids: expected a tensor, a numpy array or a list"),
    (None, None, r"input_ids: expected a tensor, a numpy array or a list"),
    # masks: only 0/1, of the ids' shape
    (torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), r"attention_mask\[0\]\[1\]: expected 0 or 1, got 2"),
    (torch.tensor([[1, 2]]), torch.tensor([[1.0, 0.5]]),
     r"attention_mask: expected a bool or integer 0/1 mask, got dtype torch\.float32"),
    (torch.tensor([[1, 2]]), torch.tensor([[1.0, 1.0]]),
     r"attention_mask: expected a bool or integer 0/1 mask"),
    (torch.tensor([[1, 2]]), [[1, 0.5]], r"attention_mask\[0\]\[1\]: expected 0 or 1, got 0\.5 \(float\)"),
    (torch.tensor([[1, 2]]), [[1, 2]], r"attention_mask\[0\]\[1\]: expected 0 or 1, got 2"),
    (torch.tensor([[1, 2]]), [["1", "1"]], r"attention_mask\[0\]\[0\]: expected 0 or 1, got a string '1'"),
    (torch.tensor([[1, 2]]), np.array([[1, 2]]), r"attention_mask\[0\]\[1\]: expected 0 or 1, got 2"),
    (torch.tensor([[1, 2]]), torch.tensor([[1, 1, 1]]),
     r"attention_mask: expected the shape of input_ids \(1, 2\), got \(1, 3\)"),
    (torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 1]),
     r"attention_mask: expected the shape of input_ids \(2, 2\), got \(1, 2\)"),
    (torch.tensor([[1, 2], [3, 4]]), [[1, 1], [1]], r"attention_mask: expected the shape of input_ids"),
    ([[1, 2, 3], [4]], [[1, 1, 1], [1]],
     r"input_ids: expected rows of one length \(padded\) with an attention_mask"),
    (torch.tensor([[1, 2]]), "11", r"attention_mask: expected a 0/1 mask, got a string"),
    # BatchEncoding / dict passed positionally
    (_encoding(torch.tensor([[0, 3]]), torch.tensor([[0, 1]])), torch.tensor([[1, 1]]),
     r"attention_mask: expected None or the same mask as input_ids\['attention_mask'\]"),
    ({"ids": [1, 2]}, None, r"input_ids: expected a tensor, a list or a mapping with the keys 'input_ids'"),
    ({"input_ids": [1, 2], "labels": [1, 2]}, None, r"got keys \['input_ids', 'labels'\]"),
    (_encoding(torch.tensor([[1.5]])), None,
     r"input_ids: expected integer token ids, got dtype torch\.float32"),
    (_encoding(torch.tensor([[1, 2]]), torch.tensor([[1, 2]])), None,
     r"input_ids\['attention_mask'\]\[0\]\[1\]: expected 0 or 1, got 2"),
])
def test_token_rows_refuses(ids, mask, match):
    with pytest.raises(ValueError, match=match):
        token_rows(ids, mask, V)


@pytest.mark.parametrize("ids, pad, refused", [
    (torch.tensor([[0, 0, 5], [4, 5, 6]]), 0, True),   # left padded, no mask
    (torch.tensor([[5, 0, 0], [4, 5, 6]]), 0, True),   # right padded
    (np.array([[5, 6, 0], [4, 5, 6]]), 0, True),
    (torch.tensor([[5, 0, 6], [4, 5, 6]]), 0, False),  # pad only inside a row: not padding
    (torch.tensor([[0, 5, 6]]), 0, False),             # one row: nothing to pad
    (torch.tensor([0, 5, 6]), 0, False),
    ([[0, 5], [4, 5, 6]], 0, False),                   # ragged lists need no padding
    (torch.tensor([[0, 5], [4, 5]]), None, False),     # the model has no pad id
])
def test_padded_batch_without_mask(ids, pad, refused):
    if refused:
        with pytest.raises(ValueError, match=r"attention_mask: expected a mask with a padded batch, got None"
                                             r".*pad_token_id=0"):
            token_rows(ids, None, V, pad_token_id=pad)
    else:
        token_rows(ids, None, V, pad_token_id=pad)
    # with the mask the same ids pass
    if isinstance(ids, torch.Tensor) and ids.shape == (2, 3):
        assert token_rows(ids, torch.ones(2, 3, dtype=torch.long), V, pad_token_id=pad) == ids.tolist()


@pytest.mark.parametrize("vocab, pad, match", [
    (0, None, r"vocab_size: expected an int >= 1, got 0"),
    (50.0, None, r"vocab_size: expected an int >= 1, got 50\.0"),
    (50, 2.0, r"pad_token_id: expected an int, got 2\.0"),
    (50, True, r"pad_token_id: expected an int, got True"),
])
def test_token_rows_own_arguments(vocab, pad, match):
    with pytest.raises(ValueError, match=match):
        token_rows([1, 2], None, vocab, pad_token_id=pad)


def test_token_rows_accepts_integral_vocab_and_pad():
    got = token_rows(torch.tensor([[1, 2], [3, 4]]), None, np.int64(V), pad_token_id=torch.tensor(0))
    assert got == [[1, 2], [3, 4]]


# -- eos ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, want", [
    (None, []),
    (2, [2]),
    (0, [0]),
    (V - 1, [V - 1]),
    (np.int64(8), [8]),
    (torch.tensor(3), [3]),                 # a 0-d tensor
    ([2, 7], [2, 7]),
    ((7, 2, 7, 2), [7, 2]),                 # duplicates dropped, first kept
    ([], []),
    (torch.tensor([4, 5]), [4, 5]),
    (np.array([9, 9, 1]), [9, 1]),
    ([np.int32(1), torch.tensor(2), 3], [1, 2, 3]),
    (list(range(8)), list(range(8))),
    ([1] * 20, [1]),                        # 20 ids, one distinct
])
def test_eos_ids_accepts(value, want):
    got = eos_ids(value, V)
    assert got == want and all(type(t) is int for t in got)


@pytest.mark.parametrize("value, match", [
    (True, r"eos_token_id: expected an int in \[0, 49\], got True \(bool\)"),
    (2.0, r"eos_token_id: expected an int in \[0, 49\], got 2\.0 \(float\)"),
    ("2", r"eos_token_id: expected None, an int or a list of ints, got '2' \(str\)"),
    (V, r"eos_token_id: expected an int in \[0, 49\], got 50"),
    (-1, r"eos_token_id: expected an int in \[0, 49\], got -1"),
    (2**64, r"eos_token_id: expected an int in \[0, 49\], got 18446744073709551616"),
    ([2, 1.0], r"eos_token_id\[1\]: expected an int in \[0, 49\], got 1\.0 \(float\)"),
    ([2, False], r"eos_token_id\[1\]: expected an int in \[0, 49\], got False"),
    ([2, "3"], r"eos_token_id\[1\]: expected an int in \[0, 49\], got '3'"),
    ([2, 500], r"eos_token_id\[1\]: expected an int in \[0, 49\], got 500"),
    ([[2]], r"eos_token_id\[0\]: expected an int in \[0, 49\], got \[2\]"),
    (torch.tensor([2.0]), r"eos_token_id: expected integer ids, got tensor"),
    (torch.tensor(2.0), r"eos_token_id: expected an int in \[0, 49\], got tensor\(2\.\)"),
    (torch.tensor([[2]]), r"eos_token_id: expected an int or a 1-D list of ints, got shape \(1, 1\)"),
    ({2}, r"eos_token_id: expected an int in \[0, 49\], got \{2\} \(set\)"),
    (list(range(9)), r"eos_token_id: expected at most 8 distinct ids, got 9"),
])
def test_eos_ids_refuses(value, match):
    with pytest.raises(ValueError, match=match):
        eos_ids(value, V)


def test_eos_ids_max_ids():
    assert eos_ids([1, 2], V, max_ids=2) == [1, 2]
    with pytest.raises(ValueError, match=r"eos_token_id: expected at most 1 distinct ids, got 2"):
        eos_ids([1, 2], V, max_ids=1)


# -- sampling ----------------------------------------------------------------------------------

_DEFAULTS = dict(do_sample=True, temperature=None, top_k=None, top_p=None, repetition_penalty=None,
                 seed=None, vocab_size=V)


@pytest.mark.parametrize("kw, want", [
    (dict(), SamplingParams(False, 1.0, V, 1.0, 1.0, None)),
    (dict(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, seed=3),
     SamplingParams(False, 0.7, 5, 0.9, 1.2, 3)),
    (dict(temperature=np.float32(0.5), top_k=np.int64(8), top_p=torch.tensor(1.0), seed=torch.tensor(0)),
     SamplingParams(False, 0.5, 8, 1.0, 1.0, 0)),
    (dict(temperature=2), SamplingParams(False, 2.0, V, 1.0, 1.0, None)),
    (dict(temperature=MIN_TEMPERATURE), SamplingParams(False, MIN_TEMPERATURE, V, 1.0, 1.0, None)),
    # the ends of what the fp32 sampling step holds
    (dict(temperature=FP32_MAX, top_p=FP32_TINY, repetition_penalty=MIN_PENALTY),
     SamplingParams(False, FP32_MAX, V, FP32_TINY, MIN_PENALTY, None)),
    (dict(repetition_penalty=FP32_MAX), SamplingParams(False, 1.0, V, 1.0, FP32_MAX, None)),
    (dict(top_k=0), SamplingParams(False, 1.0, V, 1.0, 1.0, None)),      # HF: 0 is off
    (dict(top_k=V), SamplingParams(False, 1.0, V, 1.0, 1.0, None)),
    (dict(seed=2**63 - 1), SamplingParams(False, 1.0, V, 1.0, 1.0, 2**63 - 1)),
    (dict(do_sample=np.bool_(True)), SamplingParams(False, 1.0, V, 1.0, 1.0, None)),
    # greedy: temperature / top-k / top-p have no effect (HF warns), repetition penalty still applies
    (dict(do_sample=False), SamplingParams(True, 1.0, V, 1.0, 1.0, None)),
    (dict(do_sample=False, temperature=0.0, top_k=500, top_p=5.0, repetition_penalty=1.3, seed=1),
     SamplingParams(True, 1.0, V, 1.0, 1.3, 1)),
    (dict(do_sample=False, temperature=1e-38), SamplingParams(True, 1.0, V, 1.0, 1.0, None)),
])
def test_sampling_params_accepts(kw, want):
    got = sampling_params(**{**_DEFAULTS, **kw})
    assert got == want
    assert type(got.temperature) is float and type(got.top_k) is int and type(got.top_p) is float


@pytest.mark.parametrize("kw, match", [
    (dict(do_sample="yes"), r"do_sample: expected True or False, got 'yes' \(str\)"),
    (dict(do_sample=1), r"do_sample: expected True or False, got 1 \(int\)"),
    (dict(do_sample=None), r"do_sample: expected True or False, got None"),
    (dict(temperature=1e-38), r"temperature: expected >= 0\.0001 when sampling .*do_sample=False.*got 1e-38"),
    (dict(temperature=5e-5), r"temperature: expected >= 0\.0001 when sampling"),
    (dict(temperature=0.0), r"temperature: expected a finite number > 0, got 0\.0"),
    (dict(temperature=-1.0), r"temperature: expected a finite number > 0, got -1\.0"),
    (dict(temperature="1"), r"temperature: expected a finite number > 0, got '1' \(str\)"),
    (dict(temperature=math.inf), r"temperature: expected a finite number > 0, got inf"),
    (dict(temperature=math.nan), r"temperature: expected a finite number > 0, got nan"),
    (dict(top_k=True), r"top_k: expected an int in \[0, 50\], got True \(bool\)"),
    (dict(top_k=2.0), r"top_k: expected an int in \[0, 50\], got 2\.0 \(float\)"),
    (dict(top_k=-1), r"top_k: expected an int in \[0, 50\], got -1"),
    (dict(top_k=V + 1), r"top_k: expected an int in \[0, 50\], got 51"),
    (dict(top_p=0.0), r"top_p: expected a finite number in \(0, 1\], got 0\.0"),
    (dict(top_p=1.5), r"top_p: expected a finite number in \(0, 1\], got 1\.5"),
    (dict(top_p="0.9"), r"top_p: expected a finite number in \(0, 1\], got '0\.9'"),
    (dict(top_p=True), r"top_p: expected a finite number in \(0, 1\], got True"),
    (dict(repetition_penalty=0.0), r"repetition_penalty: expected a finite number in \[1e-30, "
                                   r"3\.4028234663852886e\+38\], got 0\.0"),
    (dict(repetition_penalty="1.2"), r"repetition_penalty: expected a finite number in .*, got '1\.2'"),
    # beyond what the fp32 sampling step holds (a RuntimeError mid-run before)
    (dict(repetition_penalty=1e39), r"repetition_penalty: expected .* got 1e\+39"),
    (dict(repetition_penalty=9e-31), r"repetition_penalty: expected .* got 9e-31"),
    (dict(temperature=1e39), r"temperature: expected a finite number > 0 that float32 holds \(0 or "
                             r"a magnitude in \[1\.175e-38, 3\.403e\+38\]\), got 1e\+39"),
    (dict(top_p=1e-39), r"top_p: expected a finite number in \(0, 1\] that float32 holds .* got 1e-39"),
    (dict(seed=-1), r"seed: expected an int in \[0, 9223372036854775807\], got -1"),
    (dict(seed=2**63), r"seed: expected an int in \[0, 9223372036854775807\], got 9223372036854775808"),
    (dict(seed=1.0), r"seed: expected an int in \[0, 9223372036854775807\], got 1\.0"),
    (dict(vocab_size=0), r"vocab_size: expected an int >= 1, got 0"),
    # greedy still checks the types
    (dict(do_sample=False, temperature="1"), r"temperature: expected a finite number, got '1'"),
    (dict(do_sample=False, top_k=True), r"top_k: expected an int, got True"),
    (dict(do_sample=False, top_p="0.9"), r"top_p: expected a finite number, got '0\.9'"),
    (dict(do_sample=False, repetition_penalty=-1.0), r"repetition_penalty: expected a finite number in"),
    (dict(do_sample=False, repetition_penalty=1e39), r"repetition_penalty: expected a finite number in"),
])
def test_sampling_params_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        sampling_params(**{**_DEFAULTS, **kw})


def test_sampling_params_is_frozen():
    params = sampling_params(**_DEFAULTS)
    with pytest.raises(AttributeError):
        params.temperature = 2.0


# -- MiniKVConfig ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, want", [
    (dict(bits=np.int64(4), group_size=np.int32(32), max_batch_size=np.int64(8),
          residual_length=np.int64(64)),
     dict(bits=4, group_size=32, max_batch_size=8, residual_length=64)),
    (dict(bits=torch.tensor(16), max_new_tokens=torch.tensor(16), sink_tokens=np.int64(0)),
     dict(bits=16, max_new_tokens=16, sink_tokens=0)),
    (dict(max_prompt_len=np.uint16(128), snapkv_kernel=np.int8(7), pyramid_depth=np.int64(3),
          snapkv_window=torch.tensor(8, dtype=torch.int32), selection_block=np.int64(1)),
     dict(max_prompt_len=128, snapkv_kernel=7, pyramid_depth=3, snapkv_window=8, selection_block=1)),
    (dict(heavy_budget=np.float32(0.5), recent_budget=1), dict(heavy_budget=0.5, recent_budget=1.0)),
    (dict(compile=np.bool_(False), cuda_graphs=torch.tensor(False)), dict(compile=False, cuda_graphs=False)),
    (dict(compile=None, cuda_graphs=None), dict(compile=None, cuda_graphs=None)),
])
def test_config_stores_python_numbers(kw, want):
    cfg = MiniKVConfig(**kw)
    for name, value in want.items():
        stored = getattr(cfg, name)
        assert stored == value and type(stored) is type(value), (name, stored)
    assert MiniKVConfig(**cfg.__dict__) == cfg
    hash(cfg)


@pytest.mark.parametrize("kw, match", [
    (dict(bits=2.0), r"bits: expected an int, got 2\.0 \(float\)"),
    (dict(bits="2"), r"bits: expected an int, got '2' \(str\)"),
    (dict(bits=True), r"bits: expected an int, got True"),
    (dict(bits=np.int64(3)), r"bits: expected one of \(1, 2, 4, 16\), got 3"),
    (dict(group_size=16.0), r"group_size: expected an int, got 16\.0 \(float\)"),
    (dict(group_size=8), r"group_size: expected one of \(16, 32, 64, 128\), got 8"),
    (dict(bits=1, group_size=16), r"group_size: expected 32, 64 or 128 with bits=1 \(one int32 packs 32 tokens "
                   r"of a key group\), got 16"),
    (dict(max_batch_size=True), r"max_batch_size: expected an int >= 1, got True \(bool\)"),
    (dict(max_batch_size=0), r"max_batch_size: expected an int >= 1, got 0"),
    (dict(max_new_tokens=16.0), r"max_new_tokens: expected an int >= 1, got 16\.0"),
    (dict(max_prompt_len="64"), r"max_prompt_len: expected an int >= 1, got '64'"),
    (dict(residual_length=128.0), r"residual_length: expected an int >= 1, got 128\.0"),
    (dict(residual_length=40), r"residual_length: expected a multiple of group_size=64, got 40"),
    (dict(residual_length=40, group_size=16), r"residual_length: expected a multiple of group_size=16, got 40"),
    (dict(snapkv_kernel=8), r"snapkv_kernel: expected an odd pooling width, got 8"),
    (dict(sink_tokens=-1), r"sink_tokens: expected an int >= 0, got -1"),
    (dict(sink_tokens=4.0), r"sink_tokens: expected an int >= 0, got 4\.0"),
    (dict(pyramid_depth=0, budget_policy="pyramid"), r"pyramid_depth: expected an int >= 1, got 0"),
    (dict(heavy_budget=1.5), r"heavy_budget: expected a finite number in \[0\.0, 1\.0\], got 1\.5"),
    (dict(recent_budget="0.25"), r"recent_budget: expected a finite number in \[0\.0, 1\.0\], got '0\.25'"),
    (dict(heavy_budget=True), r"heavy_budget: expected a finite number in \[0\.0, 1\.0\], got True"),
    (dict(heavy_budget=math.nan), r"heavy_budget: expected a finite number in \[0\.0, 1\.0\], got nan"),
    (dict(compile=1), r"compile: expected True or False, got 1 \(int\)"),
    (dict(cuda_graphs="yes"), r"cuda_graphs: expected True or False, got 'yes'"),
])
def test_config_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        MiniKVConfig(**kw)


def test_the_default_is_the_accurate_cache_and_resolves_by_bits_and_ring():
    """``MiniKVConfig()`` keeps every token at 2 bits, group 64, rotated, with recall 64 and the
    speculation's resync (issue 47's choice, ``preset("accurate")``); 16 bits keep the
    uncompressed cache's group 16, no rotation, no recall and so no resync; a ring that 64 does
    not divide takes the largest group that does."""
    default = MiniKVConfig()
    assert all(getattr(default, k) == v for k, v in PRESETS["accurate"].items())
    assert default.recall_resync == "greedy"
    full = MiniKVConfig(bits=16)
    assert (full.group_size, full.rotation, full.recall_top_k, full.recall_resync) == \
        (16, "none", 0, "off")
    assert MiniKVConfig(recall_top_k=0).recall_resync == "off"  # resync follows recall
    assert MiniKVConfig.preset("accurate", recall_top_k=0).recall_resync == "off"
    assert MiniKVConfig.preset("specache").recall_resync == "off"  # the paper's, as it runs
    assert [MiniKVConfig(residual_length=r).group_size for r in (128, 96, 32, 48)] == [64, 32, 32, 16]
    assert MiniKVConfig(residual_length=32, group_size=16).group_size == 16
    snapkv = MiniKVConfig.preset("snapkv")
    assert (snapkv.heavy_budget, snapkv.group_size, snapkv.rotation, snapkv.recall_top_k) == \
        (0.25, 16, "none", 0)
