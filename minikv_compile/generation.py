"""HF ``generate()`` arguments -> what the engine runs, and the outputs HF returns.

Settings resolve as HF resolves them: the model's ``generation_config``, then a
``generation_config`` passed to the call (the fields it sets), then keyword arguments; a field
left unset by all three takes HF's default, except the length: with neither ``max_new_tokens``
nor ``max_length`` set anywhere, the engine's capacity (``MiniKVConfig.max_new_tokens``) is the
default, so a model built for 16 new tokens accepts its own default call. Everything is checked
before any work: what the engine does not implement (beams, contrastive search, ...) is a
``NotImplementedError`` naming the argument.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers import GenerationConfig

from minikv_compile.graphs.sampling import Sampling

from .inputs import check_bool, check_int, eos_ids, sampling_params

# HF's defaults for the fields the engine implements (``GenerationConfig`` leaves them None).
_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
             "repetition_penalty": 1.0, "min_length": 0}
_SUPPORTED = frozenset(["max_new_tokens", "max_length", "min_new_tokens", "min_length",
                        "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                        "eos_token_id", "pad_token_id", "return_dict_in_generate",
                        "use_cache"])
# Fields that change nothing here: ids a decoder-only call with input ids does not read, the
# cache HF would build (the engine has its own), and HF's own compile settings.
_NO_EFFECT = frozenset(["bos_token_id", "decoder_start_token_id", "cache_config",
                        "cache_implementation", "compile_config", "disable_compile",
                        "transformers_version", "_from_model_config", "max_cache_len"])


@dataclass(frozen=True)
class GenerationPlan:
    """One call's settings, validated.

    max_new_tokens: new tokens per sequence at most (``max_length`` is turned into it against the
    input width). min_new_tokens: eos ids are banned before this many. eos: ids that end a
    sequence (kept in its output). pad: the id that pads HF-style outputs (the configured pad
    id, else the first eos id, as HF does); declared_pad: the configured one alone. output:
    ``"engine"``
    (``GenerationOutput``), ``"tensor"`` (HF's default: prompt + new tokens) or ``"dict"``
    (HF's ``GenerateDecoderOnlyOutput``). keep_cache: the dict carries each sequence's
    ``PromptCache`` (``"dict"`` unless ``use_cache=False``, as HF returns its cache).
    """

    max_new_tokens: int
    min_new_tokens: int
    sampling: Sampling
    eos: Tuple[int, ...]
    pad: Optional[int]
    declared_pad: Optional[int]
    output: str
    keep_cache: bool = False


def resolve(model, generation_config, kwargs: Dict[str, Any], *, vocab_size: int,
            capacity: int, input_width: int, seed) -> GenerationPlan:
    """The plan of one call (see the module docstring); ``kwargs`` are HF's keyword arguments."""
    base = getattr(model, "generation_config", None)
    merged = copy.deepcopy(base) if isinstance(base, GenerationConfig) else GenerationConfig()
    if generation_config is not None:
        if not isinstance(generation_config, GenerationConfig):
            raise ValueError(f"generation_config: expected a transformers.GenerationConfig, "
                             f"got {type(generation_config).__name__}")
        for key, value in generation_config.to_diff_dict().items():
            setattr(merged, key, value)
    fields = merged.to_dict()  # (its fields: not its methods' names)
    unknown = sorted(k for k in kwargs if k not in fields or k.startswith("_"))
    if unknown:
        raise TypeError(f"generate: unexpected keyword argument(s) {unknown}; expected "
                        f"GenerationConfig fields, e.g. {sorted(_SUPPORTED)}")
    set_here = {k for k, v in kwargs.items() if v is not None}
    for key in set_here:
        setattr(merged, key, kwargs[key])
    if "eos_token_id" in kwargs and kwargs["eos_token_id"] is None:
        merged.eos_token_id = None  # as HF: the call's None is no eos, not the model's
    _refuse_unsupported(merged)

    def get(key):
        value = getattr(merged, key, None)
        return _DEFAULTS.get(key) if value is None else value

    max_new, max_length = merged.max_new_tokens, merged.max_length
    if max_new is not None and max_length is not None and "max_length" in set_here \
            and "max_new_tokens" not in set_here:
        max_new = None  # a max_length of the call wins over the model's max_new_tokens
    if max_new is None and max_length is not None:
        max_length = check_int("max_length", max_length, lo=1)
        max_new = max_length - input_width
        if max_new < 1:
            raise ValueError(f"max_length: expected more than the input length {input_width}, "
                             f"got {max_length}")
    if max_new is None:
        max_new = capacity
    max_new = check_int("max_new_tokens", max_new, lo=1)
    if max_new > capacity:
        raise ValueError(f"max_new_tokens: expected 1..{capacity} (the engine's max_new_tokens), "
                         f"got {max_new}")
    min_new = merged.min_new_tokens
    min_new = check_int("min_new_tokens", min_new, lo=0) if min_new is not None else max(
        0, check_int("min_length", get("min_length"), lo=0) - input_width)
    eos = eos_ids(merged.eos_token_id, vocab_size)
    pad = merged.pad_token_id
    pad = None if pad is None else check_int("pad_token_id", pad, lo=0, hi=vocab_size - 1)
    sampling = sampling_params(do_sample=get("do_sample"), temperature=get("temperature"),
                               top_k=get("top_k"), top_p=get("top_p"),
                               repetition_penalty=get("repetition_penalty"), seed=seed,
                               vocab_size=vocab_size)
    use_cache = True if merged.use_cache is None else check_bool("use_cache", merged.use_cache)
    output = "engine"
    if "return_dict_in_generate" in set_here:
        as_dict = check_bool("return_dict_in_generate", kwargs["return_dict_in_generate"])
        output = "dict" if as_dict else "tensor"
    elif merged.return_dict_in_generate:  # a GenerationConfig's: the call's or the model's
        check_bool("return_dict_in_generate", merged.return_dict_in_generate)
        output = "dict"
    return GenerationPlan(max_new_tokens=max_new, min_new_tokens=min(min_new, max_new),
                          sampling=sampling, eos=tuple(eos),
                          pad=pad if pad is not None or not eos else eos[0], declared_pad=pad,
                          output=output, keep_cache=output == "dict" and use_cache)


def _refuse_unsupported(config: GenerationConfig) -> None:
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for key, value in sorted(config.to_dict().items()):
        if key in _SUPPORTED or key in _NO_EFFECT or value is None:
            continue
        if key in defaults and value == defaults[key]:
            continue
        if key not in defaults and value in (False, 0, [], {}):
            continue
        raise NotImplementedError(f"{key}={value!r}: not supported by this engine (it decodes "
                                  f"greedily or by sampling, one sequence per prompt); "
                                  f"supported: {sorted(_SUPPORTED)}")


def check_streamer(streamer) -> None:
    """A streamer is HF's (``put`` and ``end``) or a callable taking one list per step."""
    if streamer is None or callable(streamer):
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise ValueError(f"streamer: expected an object with put() and end() (an HF streamer) or "
                         f"a callable, got {type(streamer).__name__}")


def hf_sequences(input_ids, prompts: List[List[int]], outputs: List[List[int]],
                 pad: Optional[int]) -> torch.Tensor:
    """HF's ``sequences``: the input as given (a padded tensor keeps its padding) followed by each
    row's new tokens, rows padded with ``pad`` (HF pads finished rows the same way). (B, L + n)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        head = input_ids.detach().cpu().to(torch.int64)
    elif isinstance(input_ids, torch.Tensor):
        head = input_ids.detach().cpu().to(torch.int64)[None]
    else:
        width = max(len(p) for p in prompts)
        if any(len(p) != width for p in prompts) and pad is None:
            raise ValueError("pad_token_id: expected an id to pad prompts of different lengths "
                             "into one tensor, got None")
        head = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.int64)
    n = max(len(o) for o in outputs)
    if any(len(o) != n for o in outputs) and pad is None:
        raise ValueError("pad_token_id: expected an id to pad sequences of different lengths "
                         "into one tensor, got None")
    tail = torch.tensor([o + [pad] * (n - len(o)) for o in outputs], dtype=torch.int64)
    return torch.cat([head, tail], dim=1)


def stop_flags(result: Any, batch: int) -> List[bool]:
    """A stopping criterion's answer as one flag per sequence: HF's ``(B,)`` bool (or 0/1)
    tensor, list or array; a single element (or a bool) ends or keeps every sequence, as HF's
    ``is_done | result`` broadcasts it. Any other length is refused, never zipped short."""
    try:
        flags = torch.as_tensor(result)
    except Exception:  # noqa: BLE001 -- any object torch cannot read is the caller's error
        flags = None
    if flags is None or not (flags.dtype == torch.bool or not (
            flags.dtype.is_floating_point or flags.dtype.is_complex)):
        raise ValueError(f"stopping_criteria: expected a (B,) bool tensor (one flag per "
                         f"sequence), got {type(result).__name__}"
                         + ("" if flags is None else f" of {flags.dtype}"))
    if flags.dtype != torch.bool:
        if ((flags != 0) & (flags != 1)).any():
            raise ValueError(f"stopping_criteria: expected bool flags (or 0 / 1), got values "
                             f"{sorted(set(flags.flatten().tolist()))[:8]}")
        flags = flags != 0
    if flags.ndim > 1 or flags.numel() not in (1, batch):
        raise ValueError(f"stopping_criteria: expected a result of shape ({batch},) (one flag per "
                         f"sequence) or (1,) (one for all, broadcast as HF does), got shape "
                         f"{tuple(flags.shape)}")
    return flags.flatten().tolist() * (batch if flags.numel() == 1 else 1)
