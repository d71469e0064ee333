"""How long a prefill layer takes, for the scheduler's share of prefill between decode steps."""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

__all__ = ["CHUNK", "LAYER", "PrefillClock"]

LAYER, CHUNK = "layer", "chunk"  # the kinds of piece


class PrefillClock:
    """How long a prefill layer takes, learnt from the layers run, without a host sync.

    A gap's cost is the longer of the host's time launching its layers and the GPU's time
    running them (CUDA events, read once they have passed; on the CPU the work is done when the
    call returns): a short prompt's layers are launch-bound (H100, 8B shape: ~3 ms of launches
    a layer whatever the prompt's length up to ~4k tokens, 70-100 ms gaps when the estimate
    scaled a longer prompt's cost down by tokens). The admission under way (one at a time) is
    timed by its own layers once one of its gaps has been read; before that, by the cost per
    prompt token and layer of every admission so far times its tokens, and at least the
    launches of a layer (each an average weighted toward the latest).

    Pieces of two kinds are timed apart: ``"layer"``, a layer of whole prompts (``tokens``: the
    prompts' tokens), and ``"chunk"``, a cached prompt's tail chunk through every layer
    (``tokens``: the chunk's). A chunk of ~128 tokens reads every layer's weights for few tokens,
    so its cost per token is not a prefill layer's: timed by one shared rate, tails ran several
    chunks into one gap (ITL p99 141 ms on the 8B shape under a burst of hits).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.per_token: Dict[str, float] = {}  # ms a token of a piece, by kind
        self.launch: Dict[str, float] = {}     # ms of the host's launches a piece, by kind
        self._current = None                            # the admission under way
        self._current_ms: Optional[float] = None        # its ms a layer, once read
        self._open: List[tuple] = []                    # CUDA gaps not read yet

    def start(self):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return event, time.perf_counter()

    def stop(self, start, admission, tokens: int, layers: int, kind: str = LAYER) -> None:
        _check_kind(kind)
        if layers == 0:
            return
        if admission is not self._current:
            self._current, self._current_ms = admission, None
        event, t0 = start
        host_ms = (time.perf_counter() - t0) * 1e3
        if not self.cuda:
            self._learn(admission, host_ms, host_ms, tokens, layers, kind)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((event, end, host_ms, admission, tokens, layers, kind))

    def layer_ms(self, admission, tokens: int, kind: str = LAYER) -> Optional[float]:
        """The estimate for one more piece of ``admission`` (``tokens``: a piece's tokens, of
        ``kind``); None before anything of that kind was measured."""
        _check_kind(kind)
        while self._open and self._open[0][1].query():  # recorded in order, passed in order
            start, end, host_ms, timed, n, layers, done = self._open.pop(0)
            self._learn(timed, max(start.elapsed_time(end), host_ms), host_ms, n, layers, done)
        if admission is self._current and self._current_ms is not None:
            return self._current_ms
        if kind not in self.per_token:
            return None
        return max(self.per_token[kind] * tokens, self.launch[kind])

    def forget(self, admission) -> None:
        """``admission`` ended: its gaps not read yet count for every admission alone."""
        if admission is self._current:
            self._current = self._current_ms = None

    def _learn(self, admission, ms: float, host_ms: float, tokens: int, layers: int,
               kind: str = LAYER) -> None:
        if admission is not None and admission is self._current:
            self._current_ms = ms / layers
        rate = ms / (layers * tokens)
        launch = host_ms / layers
        if kind in self.per_token:
            rate = 0.5 * (self.per_token[kind] + rate)
            launch = 0.5 * (self.launch[kind] + launch)
        self.per_token[kind], self.launch[kind] = rate, launch


def _check_kind(kind: str) -> None:
    if kind not in (LAYER, CHUNK):
        raise ValueError(f"kind: expected {LAYER!r} or {CHUNK!r}, got {kind!r}")
