"""The fixed-shape decode step, compiled once per batch-size bucket and replayed from CUDA graphs.

One step for a batch of ``B`` slots (``B`` = the bucket; a smaller request runs in it):

    tokens (Bmax,) -> minikv::cache_begin_step (every layer: per-slot flush every n_r, counters)
                   -> embed -> per layer: qkv + RoPE at the logical position
                   -> minikv::cache_write_ring (the new k/v into the ring)
                   -> minikv::decode_attention (compressed cache + ring) -> o_proj, MLP
    -> norm, lm_head -> greedy or sampled token -> written into static output buffers

Every input and output is a preallocated buffer owned by ``DecodeRunner``; counters (positions,
ring fills, the step index, finished flags) live on the device, so a replay needs no host
synchronization and no Python-side state changes between steps.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

import torch

from minikv_compile import ops

from .cache import StaticKVCache

MAX_EOS_IDS = 8  # eos_token_id may be a list (Llama 3 has several); padded with -1


def argmax_rows(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x (B, V)`` (the first index of the maximum), in two reductions.

    Compiled, a plain argmax over a 128k vocabulary at batch 1 is one reduction kernel with one
    program per row: 29 us per step on the H200. Maxima of ``chunk``-wide slices first (``V /
    chunk`` programs per row), then the first slice holding the maximum.
    """
    B, V = x.shape
    pad = (-V) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    vals, idx = x.view(B, -1, chunk).max(dim=-1)           # first maximum within each slice
    best = vals.argmax(dim=-1, keepdim=True)                  # first slice with the maximum
    return (best * chunk + idx.gather(1, best))[:, 0]


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Temperature / top-k / top-p sampling without a host sync.

    logits (B, V) fp32; temperature, top_p (B,) fp32; top_k (B,) int64 (V = off);
    noise (B, V) fp32 drawn from Exp(1). Returns (B,) int64.
    The draw is the exponential race: ``argmax_i p_i / E_i`` picks ``i`` with probability
    proportional to ``p_i``, so no cumulative search and no data-dependent shape is needed.
    """
    V = logits.shape[-1]
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(V, device=logits.device)
    # Keep a token while the mass *before* it is below top_p (so the first token always stays).
    keep = (rank[None, :] < top_k[:, None]) & ((probs.cumsum(dim=-1) - probs) < top_p[:, None])
    choice = (probs.masked_fill(~keep, 0.0) / noise).argmax(dim=-1, keepdim=True)
    return order.gather(-1, choice)[:, 0]


class DecodeRunner:
    """Static buffers, the decode step, its compiled form and its CUDA graphs.

    Buffers (``Bmax`` = cache.max_batch_size, ``N`` = max_new_tokens, ``V`` = vocab)::

        tokens      (Bmax,)   int64   the token each slot feeds this step
        positions   (Bmax,)   int64   its logical position (prompt length + steps so far)
        generated   (Bmax, N) int64   column ``step`` receives this step's sampled token
        step        ()        int64   index of the next column of ``generated``
        done        (Bmax,)   bool    slot has produced an eos token
        eos_ids     (8,)      int64   eos ids, -1 padded
        temperature, top_p (Bmax,) fp32; top_k (Bmax,) int64; noise (Bmax, V) fp32
        forced      (Bmax, N) int64   teacher mode: the tokens to feed instead of sampling
        logprobs    (Bmax, N) fp32    teacher mode: log-prob of forced[:, step] at each step

    Modes (one compiled graph each, per bucket): ``"greedy"``, ``"sample"``, ``"teacher"``.
    """

    def __init__(self, adapter, cache: StaticKVCache, *, max_new_tokens: int, compile: bool,
                 cuda_graphs: bool):
        self.adapter, self.cache = adapter, cache
        Bmax, dev, V = cache.max_batch_size, cache.device, adapter.vocab_size
        self.tokens = torch.zeros(Bmax, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(Bmax, dtype=torch.int64, device=dev)
        self.generated = torch.zeros(Bmax, max_new_tokens, dtype=torch.int64, device=dev)
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.done = torch.zeros(Bmax, dtype=torch.bool, device=dev)
        self.eos_ids = torch.full((MAX_EOS_IDS,), -1, dtype=torch.int64, device=dev)
        self.temperature = torch.ones(Bmax, dtype=torch.float32, device=dev)
        self.top_k = torch.full((Bmax,), V, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(Bmax, dtype=torch.float32, device=dev)
        self.noise = torch.ones(Bmax, V, dtype=torch.float32, device=dev)
        self.forced = torch.zeros(Bmax, max_new_tokens, dtype=torch.int64, device=dev)
        self.logprobs = torch.zeros(Bmax, max_new_tokens, dtype=torch.float32, device=dev)
        self.use_graphs = cuda_graphs
        self.compiles = 0          # graphs produced by torch.compile for the step (all buckets)
        self.replays = 0           # CUDA-graph replays
        self.compile_seconds: Dict[Tuple[int, str], float] = {}
        self._graphs: Dict[Tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._step_fn = torch.compile(self._step, fullgraph=True, dynamic=False,
                                      backend=self._count_and_compile) if compile else self._step
        self._compiled = compile

    # -- the step -----------------------------------------------------------------------------

    def _step(self, batch: int, mode: str) -> None:
        """One decode step for slots [0, batch). Mutates only the runner's and cache's buffers."""
        a, cache = self.adapter, self.cache
        tokens, positions = self.tokens[:batch], self.positions[:batch]
        h = a.embed(tokens[:, None])                              # (B, 1, hidden)
        cos, sin = a.rope(h, positions[:, None])                  # (B, 1, D)
        # Every layer's flushes and counters at once; each layer then only writes its new k/v.
        ring_index = ops.cache_begin_step([lc.buffers() for lc in cache.layers], cache.table,
                                          batch, cache.bits, cache.group_size)  # (L, B)
        normed = None  # the next input norm's share done by the launch before (the adapter's)
        for layer, lc in enumerate(cache.layers):
            q, k, v = a.qkv(layer, h, cos, sin, normed)           # q (B, H_q, 1, D), k/v (B, H_kv, 1, D)
            # Views into the q/k/v projection's output, read in place by both ops (a copy
            # would be one more kernel per tensor and layer).
            ops.cache_write_ring(k[:, :, 0], v[:, :, 0], lc.k_ring, lc.v_ring, ring_index[layer])
            o = ops.decode_attention(q[:, :, 0], *lc.buffers(), a.scale,
                                     cache.bits, cache.group_size)  # (B, H_q, D)
            h, normed = a.finish_layer_normed(layer, h, o.reshape(batch, 1, -1))
        logits = a.logits(h[:, 0])                                 # (B, V) fp32
        # The step index never passes the last column, whatever ran before (a warm-up, a
        # request longer than the buffers were told about): an out-of-range scatter would fault.
        col = self.step.clamp(max=self.generated.shape[1] - 1).expand(batch, 1)
        if mode == "greedy":
            nxt = argmax_rows(logits)
        elif mode == "sample":
            nxt = sample_tokens(logits, self.temperature[:batch], self.top_k[:batch],
                                self.top_p[:batch], self.noise[:batch])
        else:
            nxt = self.forced[:batch].gather(1, col)[:, 0]
            lp = logits.log_softmax(dim=-1).gather(1, nxt[:, None])
            self.logprobs[:batch].scatter_(1, col, lp)
        done = self.done[:batch]
        nxt = torch.where(done, tokens, nxt)  # finished slots repeat themselves, ignored later
        self.generated[:batch].scatter_(1, col, nxt[:, None])
        done |= (nxt[:, None] == self.eos_ids[None, :]).any(dim=-1)
        tokens.copy_(nxt)
        positions.add_(1)
        self.step.add_(1)

    def _count_and_compile(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        return compile_fx(gm, example_inputs)

    # -- running ------------------------------------------------------------------------------

    def run_step(self, batch: int, mode: str) -> None:
        """Advance slots [0, batch) by one token (replays the bucket's graph if there is one)."""
        key = (batch, mode)
        if self.use_graphs:
            graph = self._graphs.get(key)
            if graph is None:
                raise RuntimeError(f"no CUDA graph captured for batch {batch}, mode {mode!r}")
            graph.replay()
            self.replays += 1
            return
        if mode == "sample":
            self.noise[:batch].exponential_()
        self._call(key)

    def _call(self, key: Tuple[int, str]) -> None:
        if self._compiled and key not in self.compile_seconds:
            start = time.perf_counter()
            # One compiled graph per (bucket, mode) is expected; raise the limit so buckets do
            # not count as runaway recompilation.
            with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
                self._step_fn(*key)
            if self.cache.device.type == "cuda":
                torch.cuda.synchronize()
            self.compile_seconds[key] = time.perf_counter() - start
            return
        self._step_fn(*key)

    def prepare(self, batch: int, mode: str) -> Optional[float]:
        """Compile (if on) and capture the graph for ``(batch, mode)``; returns seconds spent.

        Warm-up steps write junk into slots [0, batch) of the cache and advance the runner's
        buffers; both are emptied again before returning, so a capture between requests leaves
        nothing behind.
        """
        key = (batch, mode)
        if not self.use_graphs or key in self._graphs:
            return None
        start = time.perf_counter()
        self.reset()  # warm-up steps start from step 0, not from where the last request ended
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile + autotune + allocator warm-up, outside the capture
                if mode == "sample":
                    self.noise[:batch].exponential_()
                self._call(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            if mode == "sample":
                self.noise[:batch].exponential_()  # graph-safe RNG: a new draw on every replay
            self._step_fn(*key)
        torch.cuda.synchronize()
        self._graphs[key] = graph
        self.cache.reset(batch)
        self.reset()
        return time.perf_counter() - start

    def reset(self) -> None:
        """Clear every per-request buffer (after warm-up, before a request)."""
        for t in (self.tokens, self.positions, self.generated, self.step, self.forced, self.logprobs):
            t.zero_()
        self.done.fill_(False)
