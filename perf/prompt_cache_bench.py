"""``python -m minikv_compile.perf prompt-cache``: what a reused compressed prompt saves (issue 46).

One engine (the library default config unless ``--config`` names a preset), batch 1, every
figure beside its baseline measured in the same run:

    ttft      time to first token of a cached ``--context`` + ``--question`` tokens (restore and
              tail prefill) against a fresh prefill of the whole prompt; target <= 5%
    chat      ``--turns`` turns over a ``--chat-doc`` document (``--turn-tokens`` user tokens,
              ``--answer-tokens`` answer tokens each), the conversation cached between turns
              (``out.past_key_values``), against re-prefilling the whole conversation every
              turn (the same conversation's tokens); total seconds and prefill-only seconds
              (each turn's first token); target total <= 1/3
    save/load ``PromptCache.save`` and ``load_prompt_cache`` of the ``--context`` cache against
              the disk's write / read and the host link's device-to-host / host-to-device
              bandwidth measured on the same bytes (ideal = bytes / link + bytes / disk);
              target >= 50%; the file's bytes against the fp16 cache's, target <= 1/6

Timings are medians of ``--repeats`` calls after one warm-up call of each kind (Triton's first
launches at new shapes). With ``--tiny``: a tiny random model and sizes, on the CPU if there is
no GPU (plumbing only).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Dict, List

PRESET = {
    "full": dict(model="llama3.1-8b", context=32768, question=256, chat_doc=16384, turns=8,
                 turn_tokens=256, answer_tokens=256, repeats=3),
    "tiny": dict(model="tiny", context=160, question=24, chat_doc=96, turns=2, turn_tokens=16,
                 answer_tokens=4, repeats=1),
}


def add_parser(sub, common, positive_int) -> None:
    p = sub.add_parser("prompt-cache", help="TTFT, chat and save/load of a cached compressed "
                                            "prompt against a fresh prefill")
    common(p, ("minikv",))
    p.add_argument("--config", default=None,
                   help="a MiniKVConfig preset name (minikv, snapkv, kivi, specache, accurate); "
                        "default: the library's default config")
    for name in ("context", "question", "chat-doc", "turns", "turn-tokens", "answer-tokens",
                 "repeats"):
        p.add_argument(f"--{name}", type=positive_int, default=None)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(torch, device, fn, repeats: int):
    """(median seconds of ``repeats`` calls after one warm-up call, the last call's result)."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        _sync(torch, device)
        start = time.perf_counter()
        out = fn()
        _sync(torch, device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _disk_and_link(torch, device, nbytes: int, folder: str) -> Dict[str, float]:
    """Seconds to move ``nbytes`` over each path a save and a load take, measured now: device
    to pinned host and back (the host link), a host buffer written to a file in ``folder`` and
    read back (the disk, through the page cache as the cache file goes)."""
    out: Dict[str, float] = {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if device.type == "cuda":
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["d2h_s"], _ = _timed(torch, device, lambda: host.copy_(dev, non_blocking=True), 3)
        out["h2d_s"], _ = _timed(torch, device, lambda: dev.copy_(host, non_blocking=True), 3)
        del dev
    path = os.path.join(folder, "bandwidth.bin")
    view = memoryview(host.numpy())

    def write():
        with open(path, "wb") as f:
            f.write(view)

    def read():
        with open(path, "rb") as f:
            return f.readinto(view)

    out["disk_write_s"], _ = _timed(torch, device, write, 3)
    out["disk_read_s"], _ = _timed(torch, device, read, 3)
    os.remove(path)
    return out


def cmd_prompt_cache(s, a) -> None:
    H, torch = s.H, s.torch
    from minikv_compile import MiniKVConfig, minikv_compile

    method = a.config or "default"
    if not s.usable():
        s.skip_all("prompt-cache", [method], "no CUDA device: this measurement needs a GPU "
                                             "(--tiny runs the plumbing on the CPU)")
        return
    model = s.load_model(a.model)
    if model is None:
        s.skip_all("prompt-cache", [method], s.model_failure)
        return
    dev, vocab = s.device, model.config.vocab_size
    longest_chat = a.chat_doc + a.turns * (a.turn_tokens + a.answer_tokens)
    # room for the whole fresh prompt, and for a cached context whose tail is kept whole
    capacity = dict(max_batch_size=1, max_new_tokens=max(a.answer_tokens, 2),
                    max_prompt_len=max(a.context + a.question, longest_chat) + a.question)
    config = MiniKVConfig.preset(a.config, **H.shape_fields(a.model), **capacity)
    holder = {}

    def build():
        start = time.perf_counter()
        holder["cm"] = minikv_compile(model, config)
        return {"build_s": time.perf_counter() - start}

    s.run({"experiment": "setup", "method": method, "what": "engine"}, build, kind="engine")
    cm = holder.get("cm")
    if cm is None:
        return
    s.report.set_context("engine_config", repr(config))
    g = torch.Generator().manual_seed(a.seed)

    def tokens(n: int) -> List[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    def row(measure: str, **fields):
        return {"experiment": "prompt-cache", "method": method, "measure": measure, **fields}

    doc, question = tokens(a.context), tokens(a.question)
    cached = {}

    def make_cache():
        seconds, cache = _timed(torch, dev, lambda: cm.cache_prompt([doc]), 1)
        cached["cache"] = cache
        mem = cache.memory()
        return {"time_s": seconds, "cache_bytes": mem.nbytes, "host_bytes": mem.host_nbytes,
                "fp16_bytes": mem.fp16_bytes, "tokens": mem.tokens}

    s.run(row("cache_prompt", prompt_len=a.context), make_cache, kind="cache_prompt")
    if "cache" not in cached:
        return
    cache = cached["cache"]
    ttft = {}

    def ttft_of(past):
        def measure():
            call = lambda: cm.generate([doc + question], past_key_values=past,  # noqa: E731
                                       max_new_tokens=1)
            ttft["cached" if past is not None else "fresh"], _ = _timed(torch, dev, call,
                                                                       a.repeats)
            return {"time_s": ttft["cached" if past is not None else "fresh"]}
        return measure

    s.run(row("ttft_cached", prompt_len=a.context + a.question, cached_tokens=a.context),
          ttft_of(cache), kind="ttft")
    s.run(row("ttft_fresh", prompt_len=a.context + a.question), ttft_of(None), kind="ttft")
    if len(ttft) == 2:
        ratio = ttft["cached"] / ttft["fresh"]
        s.report.set_context("ttft_ratio", ratio)
        s.report.note(f"target TTFT cached / fresh <= 0.05: {ratio:.4f} "
                      f"({ttft['cached'] * 1e3:.1f} ms against {ttft['fresh'] * 1e3:.1f} ms)")

    # -- chat: the cached conversation first, then the same conversation re-prefilled ---------
    chat_doc = tokens(a.chat_doc)
    turns = [tokens(a.turn_tokens) for _ in range(a.turns)]
    chat = {}

    def chat_cached():
        _sync(torch, dev)
        start = time.perf_counter()
        past = cm.cache_prompt([chat_doc])
        conversation, prompts, first = list(chat_doc), [], 0.0
        for user in turns:
            conversation += user
            prompts.append(list(conversation))
            out = cm.generate([conversation], past_key_values=past,
                              max_new_tokens=a.answer_tokens, return_dict_in_generate=True,
                              eos_check_every=a.answer_tokens)
            past = out.past_key_values
            conversation = out.sequences[0].tolist()
        _sync(torch, dev)
        chat["cached"], chat["prompts"] = time.perf_counter() - start, prompts
        return {"time_s": chat["cached"], "final_tokens": len(conversation),
                "final_cache_bytes": past.nbytes}

    def chat_reprefill():
        _sync(torch, dev)
        start = time.perf_counter()
        for prompt in chat["prompts"]:
            cm.generate([prompt], max_new_tokens=a.answer_tokens,
                        eos_check_every=a.answer_tokens)
        _sync(torch, dev)
        chat["reprefill"] = time.perf_counter() - start
        return {"time_s": chat["reprefill"]}

    def first_tokens(past_first: bool):
        """The prefill share: each turn's first token alone (max_new_tokens=1); cached, the
        tail of a turn is the answer before it and its user tokens."""
        def measure():
            _sync(torch, dev)
            start = time.perf_counter()
            past = cm.cache_prompt([chat_doc]) if past_first else None
            for prompt in chat["prompts"]:
                out = cm.generate([prompt], past_key_values=past, max_new_tokens=1,
                                  return_dict_in_generate=past_first)
                if past_first:  # the next turn's cache: this prompt (its logits kept)
                    past = out.past_key_values
            _sync(torch, dev)
            return {"time_s": time.perf_counter() - start}
        return measure

    chat_fields = dict(prompt_len=a.chat_doc, turns=a.turns, turn_tokens=a.turn_tokens,
                       answer_tokens=a.answer_tokens)
    s.run(row("chat_warmup", **chat_fields), chat_cached, kind="chat")  # every shape once
    s.run(row("chat_cached", **chat_fields), chat_cached, kind="chat")
    if "prompts" in chat:
        s.run(row("chat_reprefill", **chat_fields), chat_reprefill, kind="chat")
        first_c = s.run(row("chat_prefill_cached", **chat_fields), first_tokens(True),
                        kind="chat-prefill")
        first_f = s.run(row("chat_prefill_reprefill", **chat_fields), first_tokens(False),
                        kind="chat-prefill")
    if "reprefill" in chat:
        ratio = chat["cached"] / chat["reprefill"]
        s.report.set_context("chat_ratio", ratio)
        s.report.note(f"target chat total cached / re-prefilled <= 1/3: {ratio:.3f} "
                      f"({chat['cached']:.2f} s against {chat['reprefill']:.2f} s; the "
                      f"{a.turns} x {a.answer_tokens} decoded tokens are in both totals)")
        if first_c.get("status") == "ok" and first_f.get("status") == "ok":
            s.report.note(f"chat prefill only (each turn's first token): cached "
                          f"{first_c['time_s']:.2f} s against re-prefilled "
                          f"{first_f['time_s']:.2f} s, "
                          f"{first_c['time_s'] / first_f['time_s']:.3f}")

    # -- save / load of the --context cache ---------------------------------------------------
    folder = tempfile.mkdtemp(prefix="minikv-prompt-cache-", dir=str(s.out_dir))
    path = os.path.join(folder, "context.safetensors")
    io = {}

    def save():
        seconds, _ = _timed(torch, dev, lambda: cache.save(path), a.repeats)
        size = os.path.getsize(path)
        ref = _disk_and_link(torch, dev, size, folder)
        ideal = ref.get("d2h_s", 0.0) + ref["disk_write_s"]
        io["size"] = size
        mem = cache.memory()
        return {"time_s": seconds, "file_bytes": size, "fp16_bytes": mem.fp16_bytes,
                "file_over_fp16": size / mem.fp16_bytes, "ideal_s": ideal,
                "efficiency": ideal / seconds, **ref}

    def load():
        seconds, loaded = _timed(torch, dev, lambda: cm.load_prompt_cache(path), a.repeats)
        if loaded.token_ids != cache.token_ids:
            raise RuntimeError("load_prompt_cache: the loaded cache holds other tokens")
        ref = _disk_and_link(torch, dev, io["size"], folder)
        ideal = ref.get("h2d_s", 0.0) + ref["disk_read_s"]
        return {"time_s": seconds, "file_bytes": io["size"], "ideal_s": ideal,
                "efficiency": ideal / seconds, **ref}

    saved = s.run(row("save", prompt_len=a.context), save, kind="io")
    if saved.get("status") == "ok":
        loaded = s.run(row("load", prompt_len=a.context), load, kind="io")
        s.report.note(f"target file / fp16 cache <= 1/6: {saved['file_over_fp16']:.4f}")
        for r in (saved, loaded):
            if r.get("status") == "ok":
                s.report.note(f"target {r['measure']} at >= 50% of the disk + host link: "
                              f"{r['efficiency']:.2f} ({r['time_s'] * 1e3:.1f} ms against an "
                              f"ideal {r['ideal_s'] * 1e3:.1f} ms for {r['file_bytes']:,} bytes)")
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
