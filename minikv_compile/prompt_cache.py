"""``PromptCache``: the compressed KV state of prompts, kept to be asked again (issue 46).

A prompt cache holds, for each sequence of a batch, one slot's snapshot (``graphs.cache.
SlotSnapshot``: the valid rows of the quantized blocks, scales and zeros, the ring, the counters,
the host copy with recall, the last token's logits) and the token ids it covers, with what it
must be used with: the model's fingerprint, the compression config and the format's version.
``MiniKVModel.cache_prompt`` makes one, ``generate(..., past_key_values=cache)`` restores it
into free slots and prefills only the tail, ``save`` / ``MiniKVModel.load_prompt_cache`` keep
it on disk (one safetensors file).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from minikv_compile.graphs.cache import SlotSnapshot

FORMAT = "minikv_compile.PromptCache"
FORMAT_VERSION = 1
# The config fields a prompt cache need not match: capacities, batch size, ranks and the
# compile settings and how decoding speculates do not change what a slot holds, so a cache serves
# any engine with room for it. Every other field (selection, budgets, layout, rotation, recall)
# must match.
FREE_CONFIG_FIELDS = ("max_batch_size", "max_prompt_len", "max_new_tokens", "compile",
                      "cuda_graphs", "tensor_parallel", "recall_resync")


def cache_config(config) -> Dict[str, object]:
    """The fields of a ``MiniKVConfig`` a prompt cache must match (all but
    ``FREE_CONFIG_FIELDS``)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in FREE_CONFIG_FIELDS}


def model_fingerprint(model, adapter, dtype: torch.dtype) -> Dict[str, object]:
    """What identifies the model a cache was computed by: its architecture, sizes and dtype,
    and a SHA-256 of a few of its weights (the embedding's and LM head's first rows, the first
    and last layers' first q_proj and down_proj rows: a different checkpoint of the same shape
    differs there)."""
    layers = adapter.layers
    picks = [model.get_input_embeddings().weight[:2], model.get_output_embeddings().weight[:2]]
    for block in (layers[0], layers[-1]):
        picks += [block.self_attn.q_proj.weight[:1], block.mlp.down_proj.weight[:1]]
    digest = hashlib.sha256()
    with torch.no_grad():
        for t in picks:
            digest.update(t.detach().float().cpu().numpy().tobytes())
    config = model.config
    return {"model_type": config.model_type,
            "architectures": list(getattr(config, "architectures", None) or []),
            "num_layers": adapter.num_layers, "hidden_size": adapter.hidden_size,
            "num_q_heads": adapter.num_q_heads, "num_kv_heads": adapter.num_kv_heads,
            "head_dim": adapter.head_dim, "vocab_size": adapter.vocab_size,
            "dtype": str(dtype).replace("torch.", ""), "weights_sha256": digest.hexdigest()}


def current_versions() -> Dict[str, object]:
    """The format's version (checked on use) and the library versions that wrote it (kept for
    the record)."""
    from importlib import metadata

    import transformers

    try:
        own = metadata.version("minikv_compile")
    except metadata.PackageNotFoundError:
        own = "unknown"
    return {"format": FORMAT_VERSION, "minikv_compile": own, "torch": torch.__version__,
            "transformers": transformers.__version__}


@dataclass(frozen=True)
class PromptCacheMemory:
    """A prompt cache's bytes against an uncompressed fp16 cache of the same tokens.

    nbytes: on the device; host_nbytes: recall's host copy; fp16_bytes: K and V of every token
    of every layer at 2 bytes a value (this rank's KV heads)."""

    nbytes: int
    host_nbytes: int
    fp16_bytes: int
    tokens: int

    @property
    def ratio(self) -> float:
        """Device bytes over the fp16 cache's."""
        return self.nbytes / self.fp16_bytes if self.fp16_bytes else float("nan")

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:10.2f} MiB"  # noqa: E731
        lines = [f"prompt cache of {self.tokens} tokens",
                 f"  device              {mib(self.nbytes)}",
                 f"  uncompressed fp16   {mib(self.fp16_bytes)}",
                 f"  device / fp16       {self.ratio:9.4f}"]
        if self.host_nbytes:
            lines.append(f"  host copy (recall)  {mib(self.host_nbytes)}")
        return "\n".join(lines)


class PromptCache:
    """The compressed state of one prompt per sequence, on the engine's device, tied to no slot.

    ``token_ids[i]``: the ids sequence ``i`` holds the K/V of (a prompt given to
    ``generate(..., past_key_values=cache)`` must start with them). ``nbytes`` /
    ``host_nbytes``: its bytes on the device / in host memory (recall's copy); ``num_tokens``:
    the tokens of every sequence; ``memory()``: both against an fp16 cache. Never changed by
    use. ``save(path)`` writes it to one safetensors file.
    """

    def __init__(self, sequences: Sequence[SlotSnapshot], *, fingerprint: Dict[str, object],
                 config: Dict[str, object], device: torch.device,
                 versions: Optional[Dict[str, object]] = None):
        self.sequences: List[SlotSnapshot] = list(sequences)
        self.fingerprint, self.config = dict(fingerprint), dict(config)
        self.device = torch.device(device)
        self.versions = current_versions() if versions is None else dict(versions)

    def __len__(self) -> int:
        return len(self.sequences)

    def __repr__(self) -> str:
        return (f"PromptCache(batch={len(self)}, tokens={self.lengths}, "
                f"nbytes={self.nbytes}, device={self.device})")

    @property
    def token_ids(self) -> List[List[int]]:
        return [list(s.tokens) for s in self.sequences]

    @property
    def lengths(self) -> List[int]:
        """Tokens held per sequence."""
        return [len(s.tokens) for s in self.sequences]

    @property
    def num_tokens(self) -> int:
        """Tokens held, every sequence together."""
        return sum(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes on the device."""
        return sum(s.nbytes for s in self.sequences)

    @property
    def host_nbytes(self) -> int:
        """Bytes in host memory (recall's full-precision copy; 0 without recall)."""
        return sum(s.host_nbytes for s in self.sequences)

    def memory(self) -> PromptCacheMemory:
        """The bytes against an fp16 cache of the same tokens (``kv_memory()``'s comparison)."""
        fp = self.fingerprint
        fp16 = 2 * fp["num_layers"] * fp["num_kv_heads"] * fp["head_dim"] * 2 * self.num_tokens
        return PromptCacheMemory(nbytes=self.nbytes, host_nbytes=self.host_nbytes,
                                 fp16_bytes=fp16, tokens=self.num_tokens)

    def metadata(self) -> Dict[str, str]:
        """The file's metadata (JSON strings): format, fingerprint, config, versions, lengths."""
        return {"format": FORMAT, "fingerprint": json.dumps(self.fingerprint),
                "config": json.dumps(self.config), "versions": json.dumps(self.versions),
                "lengths": json.dumps(self.lengths)}

    def save(self, path) -> None:
        """Write the cache to ``path``: one safetensors file, the tensors of sequence ``i`` as
        ``seq{i}.layer{l}.{buffer}`` (``SlotSnapshot.tensors``) and its token ids as
        ``seq{i}.tokens`` (int64), with ``metadata()``. The device tensors are packed on the
        device and cross the host link in one copy, then written in one write (256 copies and
        writes of a 32-layer cache's tensors one by one cost more than the bytes). Atomic:
        written to a temporary file in the same folder, then renamed over ``path``."""
        device, host = {}, {}
        for i, seq in enumerate(self.sequences):
            for name, t in seq.tensors().items():  # by name, wherever this engine keeps them:
                key = f"seq{i}.{name}"                # a CPU engine's file loads on CUDA
                (host if _on_host(key) else device)[key] = t
            host[f"seq{i}.tokens"] = torch.tensor(seq.tokens, dtype=torch.int64)
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(folder, f".promptcache-{uuid.uuid4().hex}.tmp")
        # created as open() creates files (mode 0o666 less the umask), not owner-only
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                _write_safetensors(f, device, host, self.metadata())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise


# safetensors' dtype names (https://github.com/huggingface/safetensors, the format's header)
_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
                torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _on_host(name: str) -> bool:
    """Whether a file's tensor ``name`` lives in host memory when loaded (recall's host copy,
    the token ids), not on the engine's device."""
    return name.endswith(("host_k", "host_v", "tokens"))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its device."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write_safetensors(f, device: Dict[str, torch.Tensor], host: Dict[str, torch.Tensor],
                       metadata: Dict[str, str]) -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header (padded to
    8 bytes), then the tensors' bytes back to back, the device tensors first (one packed copy
    to the host), then the host tensors."""
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in list(device.items()) + list(host.items()):
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: expected one of {sorted(map(str, _DTYPE_NAMES))}, got "
                             f"{t.dtype}")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    if device:
        packed = torch.cat([_as_bytes(t) for t in device.values()])
        if packed.is_cuda:
            _write_from_device(f, packed)
        else:
            f.write(packed.numpy())
    for t in host.values():
        f.write(_as_bytes(t).numpy())


# The chunk of the pinned staging buffers between the file and the device: two of 32 MiB,
# pinned once per process (pinning a whole 0.5 GB file on every load costs ~100+ ms; reading
# it into fresh pageable memory and copying from there ran the 32k load at 0.23 of the disk +
# link bound, perf prompt-cache on an H100).
STAGING_CHUNK = 32 << 20
# per thread (a server's writer thread saves while its loop loads): no transfer waits for
# another's disk I/O
_staging = threading.local()


def _staging_buffers(chunk: int, pinned: bool) -> List[torch.Tensor]:
    """Two ``(chunk,)`` uint8 host buffers, pinned if ``pinned``, this thread's, kept for its
    next transfer (one pair a thread)."""
    if getattr(_staging, "key", None) != (chunk, pinned):
        _staging.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned)
                            for _ in range(2)]
        _staging.key = (chunk, pinned)
    return _staging.buffers


def _readinto(f, dst: torch.Tensor) -> None:
    """Fill ``dst`` (contiguous uint8, host) with the next ``dst.numel()`` bytes of ``f``
    (``ValueError`` if the file ends first)."""
    view, got = memoryview(dst.numpy()), 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"path: expected {len(view) - got} more bytes of tensor data, got "
                             f"the end of the file (truncated)")
        got += n


def _read_to_device(f, dst: torch.Tensor) -> None:
    """Fill ``dst`` (contiguous uint8, on CUDA; or on the CPU, for tests) with the next
    ``dst.numel()`` bytes of ``f``, ``STAGING_CHUNK`` bytes at a time through the two staging
    buffers: chunk ``j + 1`` is read while chunk ``j`` is copied to the device on a side
    stream; a buffer is refilled only after its last copy has finished (its event), and the
    side stream is synchronized at the end (the buffers are free for the next transfer and
    ``dst`` is written)."""
    n, chunk, cuda = dst.numel(), STAGING_CHUNK, dst.is_cuda
    bufs = _staging_buffers(chunk, pinned=cuda)
    copied: List[Optional[torch.cuda.Event]] = [None, None]
    stream = torch.cuda.Stream(dst.device) if cuda else None
    if cuda:  # dst was allocated on the current stream
        stream.wait_stream(torch.cuda.current_stream(dst.device))
    try:
        for j, off in enumerate(range(0, n, chunk)):
            b, m = j % 2, min(chunk, n - off)
            if copied[b] is not None:
                copied[b].synchronize()
            _readinto(f, bufs[b][:m])
            if cuda:
                with torch.cuda.stream(stream):
                    dst[off: off + m].copy_(bufs[b][:m], non_blocking=True)
                    copied[b] = torch.cuda.Event()
                    copied[b].record(stream)
            else:
                dst[off: off + m].copy_(bufs[b][:m])
    finally:  # also on an error: no copy may outlive dst or meet the next transfer's reads
        if cuda:
            stream.synchronize()


def _write_from_device(f, src: torch.Tensor) -> None:
    """Write ``src`` (contiguous uint8, on CUDA; or on the CPU, for tests) to ``f``,
    ``STAGING_CHUNK`` bytes at a time through the two staging buffers: chunk ``j + 1`` is
    copied to the host on a side stream while chunk ``j`` is written (its event waited for
    first). A buffer is refilled only after its write returned (writes are synchronous)."""
    n, chunk, cuda = src.numel(), STAGING_CHUNK, src.is_cuda
    offsets = list(range(0, n, chunk))
    bufs = _staging_buffers(chunk, pinned=cuda)
    stream = torch.cuda.Stream(src.device) if cuda else None
    if cuda:  # src was made on the current stream
        stream.wait_stream(torch.cuda.current_stream(src.device))

    def fetch(j: int):
        off = offsets[j]
        m = min(chunk, n - off)
        if not cuda:
            bufs[j % 2][:m].copy_(src[off: off + m])
            return None
        with torch.cuda.stream(stream):
            bufs[j % 2][:m].copy_(src[off: off + m], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    try:
        pending = fetch(0) if offsets else None
        for j, off in enumerate(offsets):
            event = pending
            if j + 1 < len(offsets):
                pending = fetch(j + 1)
            if event is not None:
                event.synchronize()
            f.write(memoryview(bufs[j % 2][: min(chunk, n - off)].numpy()))
    finally:  # also on an error (a full disk): no copy may outlive src or meet the next's
        if cuda:
            stream.synchronize()


def _read_header(f, path: str, size: int) -> dict:
    """The JSON header of the safetensors file open as ``f`` (``ValueError`` if it has none)."""
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < n <= size - 8:
        raise ValueError(f"path: expected a safetensors file, got {path!r} (no header)")
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise ValueError(f"path: expected a safetensors file, got {path!r} (its header is "
                         f"not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"path: expected a safetensors file, got {path!r}")
    return header


def check_compatible(cache, *, fingerprint: Dict[str, object], config: Dict[str, object],
                     device: torch.device, name: str = "past_key_values") -> None:
    """``ValueError`` naming the first field in which ``cache`` differs from this engine's
    model (``fingerprint``), compression config and device; or its format version."""
    if not isinstance(cache, PromptCache):
        raise ValueError(f"{name}: expected a minikv_compile.PromptCache (from cache_prompt, "
                         f"generate or load_prompt_cache), got {type(cache).__name__}")
    version = cache.versions.get("format")
    if version != FORMAT_VERSION:
        raise ValueError(f"{name}.versions.format: expected {FORMAT_VERSION}, got {version!r}")
    for what, mine, theirs in (("fingerprint", fingerprint, cache.fingerprint),
                               ("config", config, cache.config)):
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                raise ValueError(f"{name}.{what}.{key}: expected this engine's "
                                 f"{mine.get(key)!r}, got {theirs.get(key)!r} (the cache was "
                                 f"made by another model or config)")
    if cache.device != torch.device(device):
        raise ValueError(f"{name}.device: expected this engine's {device}, got {cache.device}")


# the metadata's fields and the JSON type each must parse to
_METADATA = {"fingerprint": dict, "config": dict, "versions": dict, "lengths": list}


def _metadata(header: dict, path: str) -> Dict[str, object]:
    """The parsed metadata of a file's header (``ValueError`` naming a field that is missing or
    not of its type)."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise ValueError(f"path.format: expected {FORMAT!r}, got {got!r} in {path!r}")
    out = {}
    for key, kind in _METADATA.items():
        try:
            out[key] = json.loads(meta[key])
        except (KeyError, TypeError, ValueError):
            out[key] = None
        if not isinstance(out[key], kind) or (key == "lengths" and not all(
                type(n) is int and n >= 0 for n in out[key])):
            raise ValueError(f"path.{key}: expected a JSON {kind.__name__}"
                             f"{' of token counts' if key == 'lengths' else ''} in the file's "
                             f"metadata, got {meta.get(key)!r} in {path!r}")
    return out


def _entry(name: str, e: object, size: int, path: str) -> None:
    """``ValueError`` unless the header's entry ``e`` for tensor ``name`` is a known dtype and a
    shape whose bytes are its data offsets' span, within the ``size`` bytes after the header."""
    ok = (isinstance(e, dict) and e.get("dtype") in _DTYPES
          and isinstance(e.get("shape"), list)
          and all(type(n) is int and n >= 0 for n in e["shape"])
          and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
          and all(type(n) is int for n in e["data_offsets"]))
    if ok:
        lo, hi = e["data_offsets"]
        n = _DTYPES[e["dtype"]].itemsize
        for d in e["shape"]:
            n *= d
        ok = 0 <= lo <= hi <= size and hi - lo == n
    if not ok:
        raise ValueError(f"path: expected tensor {name!r} in a known dtype with a shape whose "
                         f"bytes fit its place in the file, got {e!r} in {path!r}")


def load(path, *, fingerprint: Dict[str, object], config: Dict[str, object],
         device: torch.device, num_layers: int) -> PromptCache:
    """The cache saved at ``path`` (``PromptCache.save``), its device tensors on ``device``
    and the host copy in host memory; every field checked (``check_compatible``) before any
    tensor is read. On the CPU the file is read in one read; on CUDA its device tensors'
    bytes are read in chunks through a reused pinned staging buffer, each chunk's copy to
    the device overlapping the read of the next (``_read_to_device``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path: expected a saved prompt cache file, got {path!r}, which is not "
                         f"a file")
    size = os.path.getsize(path)
    device = torch.device(device)
    with open(path, "rb") as f:  # (one read of the header: the file checked is the file read)
        header = _read_header(f, path, size)
        meta = _metadata(header, path)
        stub = PromptCache([], fingerprint=meta["fingerprint"], config=meta["config"],
                           device=device, versions=meta["versions"])
        check_compatible(stub, fingerprint=fingerprint, config=config, device=device,
                         name="path")
        start = f.tell()
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, e in entries.items():
            _entry(name, e, size - start, path)
        spans = [entries[k]["data_offsets"] for k in entries if not _on_host(k)]
        lo = min((a for a, _ in spans), default=0)
        hi = max((b for _, b in spans), default=0)
        # the file's bytes after the header; on CUDA the device tensors' span [lo, hi)
        # (written together by save) is left unread here and streamed to the device
        data = torch.empty(size - start, dtype=torch.uint8)
        if device.type == "cuda":
            inside = [k for k, e in entries.items() if _on_host(k)
                      and max(lo, e["data_offsets"][0]) < min(hi, e["data_offsets"][1])]
            if inside:
                raise ValueError(f"path: expected the device tensors' bytes together, before "
                                 f"the host tensors' (as save writes them on CUDA), got "
                                 f"{inside[0]!r} among them")
            _readinto(f, data[:lo])
            moved = torch.empty(hi - lo, dtype=torch.uint8, device=device)
            _read_to_device(f, moved)
            _readinto(f, data[hi:])
        else:
            _readinto(f, data)
            moved = data[lo:hi].to(device)

    def tensor(name: str) -> torch.Tensor:
        e = entries[name]
        a, b = e["data_offsets"]
        src = data[a:b] if _on_host(name) else moved[a - lo: b - lo]
        # a copy: its own storage, aligned for the dtype
        return src.clone().view(_DTYPES[e["dtype"]]).reshape(e["shape"])

    sequences = []
    for i, length in enumerate(meta["lengths"]):
        head = f"seq{i}."
        if head + "tokens" not in entries:
            raise ValueError(f"path: expected {head}tokens in the file, got none")
        tokens = tensor(head + "tokens").tolist()
        if len(tokens) != length:
            raise ValueError(f"path.lengths[{i}]: expected {len(tokens)} (the file's tokens), "
                             f"got {length}")
        tensors = {k[len(head):]: tensor(k) for k in entries
                   if k.startswith(head) and k != head + "tokens"}
        sequences.append(SlotSnapshot.from_tensors(tokens, tensors, num_layers))
    return PromptCache(sequences, fingerprint=stub.fingerprint, config=stub.config,
                       device=device, versions=stub.versions)
