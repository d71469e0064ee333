"""The data-parallel front's affinity: which replica last served a prompt that starts this one.

A replica's prefix pool (``prefix_pool.py``) reuses a kept context when a new prompt starts with
all of it: a whole earlier prompt (a chat's prompt and answer). The front has no tokenizer and
cannot see the pools, so it remembers what it routed: per request, its **scope** and the hash
of its **route text**, with the replica that served it. A later request of the same scope whose
route text starts with a remembered one goes to that replica (``Replicas.pick`` may still send
it elsewhere by load), and is remembered there in turn. What it keys on:

- scope: the endpoint, ``minikv.cache_salt`` and ``minikv``'s budgets (the pool's own scope: a
  context is never shared across salts or budgets); a request with ``minikv.prefix_cache``
  false, or a body the replica will refuse, has none and is routed by load alone.
- route text: ``/v1/completions``: the prompt string, or its token ids (a list of ints);
  ``/v1/chat/completions``: each message as JSON ``[role, content, name]`` and a newline, in
  order. Turn 2 of a conversation (turn 1's messages, the answer, a new message) starts with
  turn 1's route text, so it follows turn 1 to the replica that keeps turn 1's context.

Matching is the pool's: an entry is keyed by (scope, length, polynomial hash of its characters
or ids mod 2^64); a route text's prefix hashes come from one vectorized pass, then one dict
probe per distinct entry length, longest first. A hash collision only sends a request to a
replica that has nothing for it (a miss there, no wrong answer): no text is kept to compare.
A text prefix is not always a token prefix (a completion prompt cut inside a word), which again
only costs a miss.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Any, Dict, Hashable, Optional, Tuple

import numpy as np

from ..prefix_pool import prefix_hashes

# Entries remembered, least recently used out first. Each is one routed prompt (~200 bytes);
# a lookup probes each distinct length once: at 4096 a miss costs ~2 ms (2-core CI box), and
# 4096 is more contexts than N replicas' pools hold of the long prompts where a hit matters.
MAX_ENTRIES = 4096
# Longer route texts (characters or ids) are routed by load alone: hashing takes ~40 bytes of the
# front's memory an element while it runs (a 1M-character text: ~40 MB), on up to 40 threads.
MAX_ROUTE = 1 << 20

Route = Tuple[Hashable, np.ndarray]  # (scope, prefix hashes of the route text), (L,) uint64


def route_of(path: str, obj: Any) -> Optional[Tuple[Hashable, Any]]:
    """(scope, route text or ids) of a request's parsed JSON body (see the module), or None
    when it has no affinity: prefix reuse off, a body the replica will answer 400, or a route
    longer than ``MAX_ROUTE``."""
    found = _route_of(path, obj)
    return found if found is not None and len(found[1]) <= MAX_ROUTE else None


def _route_of(path: str, obj: Any) -> Optional[Tuple[Hashable, Any]]:
    if not isinstance(obj, dict):
        return None
    minikv = obj.get("minikv") or {}
    if not isinstance(minikv, dict) or minikv.get("prefix_cache") is False:
        return None
    salt = minikv.get("cache_salt")
    budgets = (minikv.get("heavy_budget"), minikv.get("recent_budget"))
    if not (salt is None or isinstance(salt, str)) or not all(
            b is None or isinstance(b, (int, float)) for b in budgets):
        return None
    if path.endswith("/chat/completions"):
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) for m in messages):
            return None
        text = "".join(json.dumps([m.get("role"), m.get("content"), m.get("name")],
                                  ensure_ascii=False) + "\n" for m in messages)
        return ("chat", salt, budgets), text
    prompt = obj.get("prompt")
    if isinstance(prompt, str) and prompt:
        return ("text", salt, budgets), prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**32
                                                   for t in prompt):
        return ("ids", salt, budgets), prompt
    return None


def hashes_of(route: Any) -> np.ndarray:
    """Prefix hashes (L,) uint64 of a route text (its code points) or a list of token ids."""
    if isinstance(route, str):
        return prefix_hashes(np.frombuffer(route.encode("utf-32-le"), dtype=np.uint32))
    return prefix_hashes(route)


class Affinity:
    """(scope, length, hash) -> the replica that last served that route text, an LRU of at
    most ``max_entries``. Thread-safe (the event loop and ``/metrics`` read it)."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        if not (type(max_entries) is int and max_entries >= 1):
            raise ValueError(f"max_entries: expected an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: "collections.OrderedDict[Tuple, int]" = collections.OrderedDict()
        self._lengths: Dict[Hashable, collections.Counter] = {}  # scope -> length -> entries
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, scope: Hashable, route: Any
             ) -> Tuple[Tuple[int, int], Optional[Tuple[int, int]]]:
        """(what ``remember_last`` takes of ``route``, a text or token ids: its length and last
        prefix hash; ``match``'s replica and length). The hashes themselves are not kept."""
        hashes = hashes_of(route)
        return (len(hashes), int(hashes[-1])), self.match(scope, hashes)

    def lookup(self, scope: Hashable, hashes: np.ndarray) -> Optional[int]:
        """``match``'s replica alone."""
        found = self.match(scope, hashes)
        return None if found is None else found[0]

    def match(self, scope: Hashable, hashes: np.ndarray) -> Optional[Tuple[int, int]]:
        """(replica, length) of the longest remembered route text of ``scope`` that starts this
        one (``hashes``: its prefix hashes), now the most recently used; None when there is
        none."""
        with self._lock:
            lengths = self._lengths.get(scope, ())
            for n in sorted((n for n in lengths if n <= len(hashes)), reverse=True):
                key = (scope, n, int(hashes[n - 1]))
                replica = self._entries.get(key)
                if replica is not None:
                    self._entries.move_to_end(key)
                    return replica, n
        return None

    def remember_last(self, scope: Hashable, length: int, last: int, replica: int) -> None:
        """The route text of this length and last prefix hash (``find``'s first value) was sent
        to ``replica``: the most recent entry, replacing one of the same text; the least
        recently used out past ``max_entries``."""
        key = (scope, length, last)
        with self._lock:
            if key not in self._entries:
                self._lengths.setdefault(scope, collections.Counter())[length] += 1
            self._entries[key] = replica
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._forget(self._entries.popitem(last=False)[0])

    def forget_replica(self, replica: int) -> None:
        """Drop every entry of ``replica`` (it died: its pool went with it)."""
        with self._lock:
            for key in [k for k, r in self._entries.items() if r == replica]:
                del self._entries[key]
                self._forget(key)

    def _forget(self, key: Tuple) -> None:
        scope, n, _ = key
        counts = self._lengths[scope]
        counts[n] -= 1
        if not counts[n]:
            del counts[n]
            if not counts:
                del self._lengths[scope]


__all__ = ["Affinity", "MAX_ENTRIES", "MAX_ROUTE", "hashes_of", "route_of"]
