"""The server's pool of compressed contexts, reused by the requests whose prompts start with them.

An entry is one slot's ``SlotSnapshot`` (the compressed K/V of its tokens) in a scope: the
requests of one cache salt and one pair of selection budgets (a context compressed with other
budgets holds other tokens, so it is never shared across them). ``lookup`` finds the longest
entry of a scope whose tokens start a prompt, ``add`` keeps a new one; both tiers (the device,
and optionally host memory) are bounded in bytes, least recently used first out: an entry
evicted from the device moves to host memory when that tier is on, and back on a hit.

Boundaries are whole prompts and whole conversations, not blocks of tokens: a compressed
context's selection depends on its whole length (the budgets are fractions of it, the scores
sum over its last window), so the state of a prompt's first k tokens is not a part of the state
of the whole prompt, and a fixed block of a compressed cache cannot be cut out and reused.

Matching: each entry is keyed by (scope, length, the polynomial hash of its tokens mod 2^64);
a prompt's prefix hashes come from one vectorized pass (O(prompt length)), then one dict probe
per distinct entry length and a token comparison of the candidate (hash collisions miss).
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from minikv_compile.graphs.cache import SlotSnapshot

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: every power is a unit mod 2^64


def prefix_hashes(tokens: Sequence[int]) -> np.ndarray:
    """``h[i]`` = the hash of ``tokens[: i + 1]``: sum of ``(t_j + 1) * B^j`` mod 2^64, (L,)
    uint64 (the ``+ 1`` keeps a leading token 0 from hashing as nothing)."""
    t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        return np.cumsum(t * _powers(len(t)), dtype=np.uint64)


def _powers(n: int) -> np.ndarray:
    """``B^0 .. B^(n-1)`` mod 2^64, (n,) uint64."""
    out = np.empty(n, dtype=np.uint64)
    if n:
        out[0] = 1
        with np.errstate(over="ignore"):
            out[1:] = np.cumprod(np.full(n - 1, _BASE, dtype=np.uint64), dtype=np.uint64)
    return out


def snapshot_bytes(snap: SlotSnapshot) -> int:
    """Every byte ``snap`` holds: its device tensors, its last logits, recall's host copy."""
    logits = 0 if snap.logits is None else snap.logits.nbytes
    return snap.nbytes + snap.host_nbytes + logits


def _moved(snap: SlotSnapshot, device: torch.device) -> SlotSnapshot:
    """``snap`` with its cache tensors and logits on ``device`` (recall's host copy stays)."""
    layers = [{k: t.to(device) for k, t in layer.items()} for layer in snap.layers]
    logits = None if snap.logits is None else snap.logits.to(device)
    return SlotSnapshot(tokens=snap.tokens, lens=snap.lens, layers=layers, host=snap.host,
                        logits=logits)


@dataclass
class _Entry:
    scope: Hashable
    tokens: np.ndarray   # (n,) int64
    key: Tuple[Hashable, int, int]
    snapshot: SlotSnapshot
    nbytes: int
    on_device: bool


class PrefixPool:
    """Contexts in LRU order within ``gpu_bytes`` on the device and ``host_bytes`` in host
    memory (0: no host tier). An entry counts all its bytes (``snapshot_bytes``) in the tier
    that holds it. Used by one thread (the scheduler's loop).

    device: where restored snapshots must be (the engine's). loader: called on a miss with
    (scope, prompt, prefix hashes), returns a snapshot found elsewhere (the disk) or None;
    it is added like any other context.
    """

    def __init__(self, gpu_bytes: int, host_bytes: int = 0, *,
                 device: torch.device = torch.device("cpu"),
                 loader: Optional[Callable[[Hashable, Sequence[int], np.ndarray],
                                           Optional[SlotSnapshot]]] = None):
        for name, value in (("gpu_bytes", gpu_bytes), ("host_bytes", host_bytes)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        if host_bytes and not gpu_bytes:
            raise ValueError(f"host_bytes: expected 0 while gpu_bytes is 0 (reuse off), got "
                             f"{host_bytes}")
        self.gpu_bytes, self.host_bytes = gpu_bytes, host_bytes
        self.device, self.loader = torch.device(device), loader
        self._entries: "collections.OrderedDict[Tuple, _Entry]" = collections.OrderedDict()
        self._lengths: Dict[int, int] = collections.Counter()  # entry length -> entries
        # bytes held per tier (True: the device), kept as ints: /metrics reads them from
        # another thread while the loop changes the entries
        self._held = {True: 0, False: 0}
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.gpu_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device."""
        return self._held[True]

    @property
    def host_nbytes(self) -> int:
        """Bytes held in the host tier."""
        return self._held[False]

    def contexts(self) -> List[Tuple[Hashable, Tuple[int, ...], bool]]:
        """(scope, tokens, on the device) of each entry, least recently used first."""
        return [(e.scope, tuple(e.snapshot.tokens), e.on_device) for e in self._entries.values()]

    def lookup(self, scope: Hashable, prompt: Sequence[int]) -> Optional[SlotSnapshot]:
        """The longest context of ``scope`` whose tokens start ``prompt`` and leave a token to
        prefill (or hold the logits of their last one), on the device, now the most recently
        used; then the loader's; None on a miss."""
        if not self.enabled or not prompt:
            return None
        hashes = prefix_hashes(prompt)
        ids = np.asarray(prompt, dtype=np.int64)
        for n in sorted((n for n in self._lengths if n <= len(prompt)), reverse=True):
            entry = self._entries.get((scope, n, int(hashes[n - 1])))
            if entry is None or not np.array_equal(entry.tokens, ids[:n]):
                continue
            if n == len(prompt) and entry.snapshot.logits is None:
                continue
            self._entries.move_to_end(entry.key)
            if not entry.on_device:
                self._promote(entry)
            return entry.snapshot
        if self.loader is not None:
            snap = self.loader(scope, prompt, hashes)
            if snap is not None:
                self.add(scope, snap)
                return snap
        return None

    def add(self, scope: Hashable, snap: SlotSnapshot) -> bool:
        """Keep ``snap`` as the most recently used context of ``scope`` (replacing one of the
        same tokens), evicting the least recently used ones to make room; False (nothing kept,
        nothing evicted) when it alone exceeds the device bound."""
        size = snapshot_bytes(snap)
        if not self.enabled or size > self.gpu_bytes or not snap.tokens:
            return False
        tokens = np.asarray(snap.tokens, dtype=np.int64)
        key = (scope, len(tokens), int(prefix_hashes(snap.tokens)[-1]))
        if key in self._entries:
            self._drop(key)
        entry = _Entry(scope, tokens, key, snap, size, True)
        self._entries[key] = entry
        self._lengths[len(tokens)] += 1
        self._held[True] += size
        self._fit(keep=key)
        return True

    def _promote(self, entry: _Entry) -> None:
        """A host-tier entry back on the device (its bytes now count there)."""
        self._move(entry, True)
        self._fit(keep=entry.key)

    def _move(self, entry: _Entry, on_device: bool) -> None:
        entry.snapshot = _moved(entry.snapshot, self.device if on_device
                                else torch.device("cpu"))
        self._held[entry.on_device] -= entry.nbytes
        self._held[on_device] += entry.nbytes
        entry.on_device = on_device

    def _fit(self, keep: Tuple) -> None:
        """Evict least recently used entries until both tiers are within their bounds (never
        ``keep``): a device entry moves to the host tier when it fits there, else goes."""
        for on_device, bound in ((True, self.gpu_bytes), (False, self.host_bytes)):
            for key in list(self._entries):
                if self._held[on_device] <= bound:
                    break
                entry = self._entries[key]
                if key == keep or entry.on_device != on_device:
                    continue
                if on_device and entry.nbytes <= self.host_bytes:
                    self._move(entry, False)
                else:
                    self._drop(key)
                    self.evictions += 1

    def _drop(self, key: Tuple) -> None:
        entry = self._entries.pop(key)
        self._held[entry.on_device] -= entry.nbytes
        self._lengths[len(entry.tokens)] -= 1
        if not self._lengths[len(entry.tokens)]:
            del self._lengths[len(entry.tokens)]


def scope_name(scope: Hashable) -> str:
    """A file-name-safe digest of a scope (16 hex digits)."""
    return hashlib.sha256(repr(scope).encode()).hexdigest()[:16]


class DiskContexts:
    """Contexts saved as ``PromptCache`` files in ``folder``, one per context, named by scope,
    length and hash (``{scope}-{length}-{hash}.safetensors``), so that a lookup probes names
    and reads only the file that matches. ``save(scope, snap)`` queues one for a writer thread
    (``write``, atomic by ``PromptCache.save``: a 16k-token context of the 8B shape is ~200 MB,
    a stall of every stream if written on the scheduler's loop); ``flush`` waits for the queue.
    ``load(scope, prompt, hashes)`` reads the longest that starts the prompt through ``read``
    (a path -> ``SlotSnapshot``; a file of another model or config raises ``ValueError`` there
    and is skipped), on the caller's thread. Unbounded: the folder is the operator's."""

    SUFFIX = ".safetensors"

    def __init__(self, folder, write: Callable[[SlotSnapshot, str], None],
                 read: Callable[[str], SlotSnapshot]):
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self._write, self._read = write, read
        self._lock = threading.Lock()  # the names and lengths: the writer adds to them
        self._names = set()
        self._lengths = set()
        self._queued = set()
        for name in os.listdir(self.folder):
            parts = name[: -len(self.SUFFIX)].split("-") if name.endswith(self.SUFFIX) else []
            if len(parts) == 3 and parts[1].isdigit():
                self._names.add(name)
                self._lengths.add(int(parts[1]))
        self.skipped: List[str] = []  # files refused on load, with why
        self.failed: List[str] = []   # writes that failed, with why (also logged)
        self.loads = 0  # contexts read back
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="minikv-prefix-writer",
                                        daemon=True)
        self._thread.start()

    def _name(self, scope: Hashable, n: int, h: int) -> str:
        return f"{scope_name(scope)}-{n}-{h:016x}{self.SUFFIX}"

    def save(self, scope: Hashable, snap: SlotSnapshot) -> None:
        n = len(snap.tokens)
        name = self._name(scope, n, int(prefix_hashes(snap.tokens)[-1]))
        with self._lock:
            if name in self._names or name in self._queued:
                return
            self._queued.add(name)
        self._queue.put((name, n, snap))

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            name, n, snap = item
            try:
                self._write(snap, os.path.join(self.folder, name))
            except Exception as e:  # a full disk, say: the context stays in memory only
                self.failed.append(f"{name}: {type(e).__name__}: {e}")
                logging.getLogger("minikv_compile.serve").warning(
                    "prefix cache: could not save %s: %s", name, e)
            else:
                with self._lock:
                    self._names.add(name)
                    self._lengths.add(n)
            finally:
                with self._lock:
                    self._queued.discard(name)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued context is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(None)
        self._thread.join()

    def load(self, scope: Hashable, prompt: Sequence[int], hashes: np.ndarray
             ) -> Optional[SlotSnapshot]:
        with self._lock:
            lengths = sorted((n for n in self._lengths if n <= len(prompt)), reverse=True)
        for n in lengths:
            name = self._name(scope, n, int(hashes[n - 1]))
            with self._lock:
                if name not in self._names:
                    continue
            try:
                snap = self._read(os.path.join(self.folder, name))
            except Exception as e:  # noqa: BLE001 -- a context not read is a miss, not a 500
                self.skipped.append(f"{name}: {type(e).__name__}: {e}")
                with self._lock:
                    self._names.discard(name)
                continue
            if list(snap.tokens) != list(prompt[:n]) or (n == len(prompt)
                                                        and snap.logits is None):
                continue
            self.loads += 1
            return snap
        return None


__all__ = ["DiskContexts", "PrefixPool", "prefix_hashes", "scope_name", "snapshot_bytes"]
