"""The one owner of the decode step's compile, CUDA-graph capture and replay.

``GraphRunner`` compiles the parts of the step (graphs/decode.py's ``DecodeStep``: the start,
one layer, the choice of the token), captures one CUDA graph per (bucket, mode) after warm-up,
replays it, and counts compiles and replays so that a test (and a benchmark) can prove the
graphs are really replayed and nothing recompiles. Nobody else calls the step.

Warm-up runs the real step on the real buffers, so it must not disturb slots that are
mid-generation when a new bucket is captured: it runs with every slot marked inactive (the step
then leaves the cache as it is, by the contract of ``cache_begin_step``), and every slot-state
buffer is restored from a snapshot afterwards.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

Key = Tuple[int, str]  # (bucket, mode)


class GraphRunner:
    """Runs a key ``(batch, mode)`` as ``step(slots, mode)`` with ``slots = active[:batch]``:
    the parts the step asks for compiled (``torch.compile(fullgraph=True)``) if ``compile``, the
    whole step replayed from one CUDA graph per key if ``cuda_graphs``.

    build_step(compile_part) -> step: builds the step, handing each part it wants compiled to
        ``compile_part`` (``torch.compile`` through the runner's counting backend; None without
        ``compile``: the parts run as they are). The step decides which buckets share a compiled part (the
        dynamic sizes it marks): ``DecodeStep``.
    state_buffers: every tensor the step writes besides the cache (restored after warm-up).
    active: the ``(Bmax,)`` bool tensor that admits slots to the step (one of
        ``state_buffers``); zeroed during warm-up so that the step writes no cache buffer.
    """

    def __init__(self, build_step: Callable[[Callable], Callable[[torch.Tensor, str], None]], *,
                 device: torch.device, compile: bool, cuda_graphs: bool,
                 state_buffers: List[torch.Tensor], active: torch.Tensor):
        self.device, self.use_graphs, self._compiled = device, cuda_graphs, compile
        self._state, self._active = state_buffers, active
        self.compiles = 0                      # graphs torch.compile produced (every part)
        self.replays = 0                       # CUDA-graph replays
        self.compile_seconds: Dict[Key, float] = {}
        self.capture_seconds: Dict[Key, float] = {}
        self._graphs: Dict[Key, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        # dynamic=None: only what is marked (or changes between calls) is symbolic; weights
        # and cache buffers keep their static shapes.
        compile_part = (functools.partial(torch.compile, fullgraph=True, dynamic=None,
                                          backend=self._backend) if compile else None)
        self._step = build_step(compile_part)

    @property
    def graphs(self) -> List[Key]:
        return sorted(self._graphs)

    def ready(self, key: Key) -> bool:
        """Whether ``run(key)`` needs no compile or capture first."""
        if self.use_graphs:
            return key in self._graphs
        return not self._compiled or key in self.compile_seconds

    def prepare(self, key: Key) -> Optional[float]:
        """Compile and capture ``key`` now if it is not ready; returns the seconds spent."""
        if self.ready(key):
            return None
        start = time.perf_counter()
        snapshot = [t.clone() for t in self._state]  # (the cache is left alone by the mask)
        self._active.zero_()
        try:
            if self.use_graphs:
                self._capture(key)
            else:
                self._call(key)
        finally:
            for t, saved in zip(self._state, snapshot):
                t.copy_(saved)
        spent = time.perf_counter() - start
        if self.use_graphs:
            self.capture_seconds[key] = spent  # compile, warm-up and capture together
        return spent

    def run(self, key: Key) -> None:
        """One step of ``key`` (``prepare`` first if it is not ready)."""
        self.prepare(key)
        if self.use_graphs:
            self._graphs[key].replay()
            self.replays += 1
        else:
            self._call(key)

    # -- internals -----------------------------------------------------------------------------

    def _capture(self, key: Key) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile + autotune + allocator warm-up, outside the capture
                self._call(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # A host sync (or a host-to-device copy from pageable memory) inside the step would be
        # baked out of the graph; the guard makes it an error at capture instead.
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._invoke(key)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
        self._graphs[key] = graph

    def _invoke(self, key: Key) -> None:
        batch, mode = key
        self._step(self._active[:batch], mode)

    def _call(self, key: Key) -> None:
        if not self._compiled or key in self.compile_seconds:
            self._invoke(key)
            return
        start = time.perf_counter()
        # A few compiled graphs per part are expected (batch 1, and one per set of buckets with
        # the same plan or mode, or per kind of layer); raise the limit so that they do not
        # count as runaway recompilation.
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
            self._invoke(key)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_seconds[key] = time.perf_counter() - start

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        return compile_fx(gm, example_inputs)

