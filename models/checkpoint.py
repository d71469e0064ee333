"""Loading one rank's shard of a Llama-family checkpoint without the whole model
(``load_shard``): read by the plan ``parallel.shard_model`` cuts by."""
from __future__ import annotations

from typing import Union

import torch
from torch import nn

from .parallel import TensorParallel, _cut, _shard_plan, row_share


def load_shard(model_dir, tp: TensorParallel, device: Union[str, torch.device],
               dtype: torch.dtype) -> nn.Module:
    """Rank ``tp.rank``'s shard (``shard_model``'s) of the Llama-family checkpoint in
    ``model_dir`` (an HF model directory with ``model.safetensors`` or an index of several
    files), read share by share: the model is built on the meta device, cut, materialized on
    ``device`` and each parameter filled with only this rank's bytes of the checkpoint
    (safetensors slices), so that neither the host nor the device ever holds the whole model
    (a 70B model in bf16, ~141 GB, fits neither one H200 nor the host beside a second rank's
    copy). RoPE's buffers are computed anew; the model is in eval mode, marked as the shard.

    ``ValueError`` when the directory has no safetensors checkpoint or the checkpoint lacks a
    parameter of the model (named); a tied LM head reads the input embeddings.
    """
    import json
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = {name: model_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    elif (model_dir / "model.safetensors").is_file():
        with safe_open(model_dir / "model.safetensors", framework="pt") as f:
            files = {name: model_dir / "model.safetensors" for name in f.keys()}
    else:
        raise ValueError(f"model: expected an HF model directory with model.safetensors or "
                         f"model.safetensors.index.json, got {str(model_dir)!r} without them")
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plan = _shard_plan(model, tp)
    _cut(model, plan, tp)
    model.to_empty(device=device)
    opened = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            source = name
            if name not in files and name == "lm_head.weight":
                source = "model.embed_tokens.weight"  # tied to the input embeddings
            if source not in files:
                raise ValueError(f"model: expected the checkpoint in {str(model_dir)!r} to "
                                 f"hold {source!r}, got no such tensor")
            path = files[source]
            if path not in opened:
                opened[path] = safe_open(path, framework="pt")
            part = opened[path].get_slice(source)
            how, cut = plan.get(name, ("whole", None))
            if how == "zero":
                p.zero_()
                continue
            if how == "rows":
                t = part[cut]
            elif how == "cols":
                t = part[:, cut]
            elif how == "vocab":  # shard_rows, read from the file
                rows, _ = row_share(part.get_shape()[0], tp)
                t = torch.zeros(p.shape, dtype=p.dtype)
                t[: rows.stop - rows.start] = part[rows]
            else:
                t = part[:]
            p.copy_(t.to(dtype))
    with torch.device(device):  # (not weights: computed, not loaded)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    if (model_dir / "generation_config.json").is_file():  # as from_pretrained reads it
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval()


__all__ = ["load_shard"]
