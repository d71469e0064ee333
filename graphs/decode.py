"""Per-slot decode state and the fixed-shape decode step over the slots of one bucket.

One step for the slots ``[0, B)`` of a bucket ``B`` (``DecodeStep``)::

    tokens -> minikv::cache_begin_step (every layer: per-slot flush every n_r, counters; live
              slots only)
           -> embed, RoPE at each slot's logical position                          (``begin``)
    -> per layer: q/k/v (+ RoPE), minikv::cache_write_ring (the new k/v into the ring),
       minikv::decode_attention (compressed cache + ring), o_proj, MLP             (``layer``)
    -> norm, lm_head, each slot's next token (greedy, sampled or forced), written at its own
       column; counters and finished flags advance for live slots              (``choose``)

A slot is *live* while it is admitted and not finished. Slots that are not live go through the
same arithmetic (their share of the launch) but change nothing: the cache is not touched, their
counters stay, and their token is written to a scratch column. Every input and output is a
preallocated buffer of ``SlotState``, so a replay needs no host synchronization.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch

from minikv_compile import ops

from .cache import StaticKVCache
from .sampling import argmax_rows, choose_tokens
from .step_plan import StepPlan

MAX_EOS_IDS = 8  # eos ids per slot (Llama 3 has several); padded with -1
MODES = ("greedy", "sample", "teacher")


class SlotState:
    """The device state of ``Bmax`` slots (``N`` = max new tokens, ``V`` = vocabulary)::

        tokens      (Bmax,)       int64  the token each slot feeds next
        positions   (Bmax,)       int64  its logical position (prompt length + tokens fed so far)
        count       (Bmax,)       int64  tokens the slot has generated (its next column)
        limit       (Bmax,)       int64  its max_new_tokens
        minimum     (Bmax,)       int64  its min_new_tokens: eos ids are banned before
        active      (Bmax,)       bool   admitted (set once its first token is chosen), not
                                         released
        done        (Bmax,)       bool   finished: an eos id, or ``count == limit``
        eos_ids     (Bmax, 8)     int64  its eos ids, -1 padded
        greedy      (Bmax,)       bool   and temperature, top_p, penalty (Bmax,) fp32,
        top_k       (Bmax,)       int64  seed (Bmax,) int64: its sampling parameters
        seen        (Bmax, V)     bool   tokens of its prompt and output (repetition penalty)
        generated   (Bmax, N + 1) int64  column ``count`` gets the next token; column N is
                                         the scratch column of slots that are not live
        forced      (Bmax, N)     int64  teacher mode: the tokens to feed instead of choosing
        logprobs    (Bmax, N + 1) fp32   teacher mode: log-prob of the forced token per column;
                                         column N is the scratch column again
        spec        (Bmax,)       int64  SpeCache: the speculative token fed beside ``tokens``
        pre         (Bmax,)       bool   SpeCache: the slot's next step is its pre-decoding
                                         one (after admission; unless ``recall_resync`` is
                                         "off", after a missed guess too)
    """

    def __init__(self, max_batch_size: int, max_new_tokens: int, vocab_size: int,
                 device: torch.device):
        B, N, V, dev = max_batch_size, max_new_tokens, vocab_size, device
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        self.max_new_tokens, self.vocab_size = N, V
        self.tokens = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.count = torch.zeros(B, **i64)
        self.limit = torch.zeros(B, **i64)
        self.minimum = torch.zeros(B, **i64)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.eos_ids = torch.full((B, MAX_EOS_IDS), -1, **i64)
        self.greedy = torch.ones(B, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(B, **f32)
        self.top_k = torch.full((B,), V, **i64)
        self.top_p = torch.ones(B, **f32)
        self.penalty = torch.ones(B, **f32)
        self.seed = torch.zeros(B, **i64)
        self.seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        self.generated = torch.zeros(B, N + 1, **i64)
        self.forced = torch.zeros(B, N, **i64)
        self.logprobs = torch.zeros(B, N + 1, **f32)
        self.spec = torch.zeros(B, **i64)
        self.pre = torch.zeros(B, dtype=torch.bool, device=dev)

    def buffers(self) -> list:
        """Every buffer (what a graph's warm-up must leave as it found)."""
        return [self.tokens, self.positions, self.count, self.limit, self.minimum, self.active,
                self.done,
                self.eos_ids, self.greedy, self.temperature, self.top_k, self.top_p, self.penalty,
                self.seed, self.seen, self.generated, self.forced, self.logprobs, self.spec,
                self.pre]

    def choose(self, logits: torch.Tensor, rows: slice, mode: str, live: torch.Tensor
               ) -> torch.Tensor:
        """The next token of slots ``rows`` from their logits (B, V) fp32 -> (B,) int64.

        The one rule of the project: the decode step calls it for its bucket, admission for the
        first token of one slot. Teacher mode feeds ``forced`` and records its log-probability
        (live rows at their column, the others in the scratch column).
        """
        count = self.count[rows]
        if mode == "greedy":
            return argmax_rows(logits)
        if mode == "sample":
            eos = self.eos_ids[rows]                                # (B, 8), -1 padded
            is_eos = torch.zeros_like(logits, dtype=torch.int32).scatter_add_(
                1, eos.clamp(min=0), (eos >= 0).int()) > 0          # (B, V)
            banned = is_eos & (count < self.minimum[rows])[:, None]
            logits = logits.masked_fill(banned, float("-inf"))
            return choose_tokens(logits, greedy=self.greedy[rows],
                                 temperature=self.temperature[rows], top_k=self.top_k[rows],
                                 top_p=self.top_p[rows], penalty=self.penalty[rows],
                                 seen=self.seen[rows], seed=self.seed[rows], counter=count)
        forced = self.forced[rows].gather(1, count.clamp(max=self.max_new_tokens - 1)[:, None])
        col = torch.where(live, count, self.max_new_tokens)[:, None]
        self.logprobs[rows].scatter_(1, col, logits.log_softmax(dim=-1).gather(1, forced))
        return forced[:, 0]

    def record(self, nxt: torch.Tensor, rows: slice, live: torch.Tensor) -> None:
        """Store each live slot's new token ``nxt`` (B,) at its column, advance its counters and
        set its finished flag; slots that are not live keep everything but the scratch column."""
        count, done = self.count[rows], self.done[rows]
        nxt = torch.where(live, nxt, self.tokens[rows])
        col = torch.where(live, count, self.max_new_tokens)[:, None]
        self.generated[rows].scatter_(1, col, nxt[:, None])
        seen = self.seen[rows]  # (a slot that is not live writes back what it held)
        seen.scatter_(1, nxt[:, None], live[:, None] | seen.gather(1, nxt[:, None]))
        count.add_(live.long())
        self.positions[rows].add_(live.long())
        eos = (nxt[:, None] == self.eos_ids[rows]).any(dim=-1)
        done.logical_or_(live & (eos | (count >= self.limit[rows])))
        self.tokens[rows].copy_(nxt)


class DecodeStep:
    """One decode step of the slots ``[0, B)`` of a bucket, ``step(slots, mode)`` with ``slots =
    state.active[:B]``, by the plan of ``(B, mode)`` (``plans``: the ``StepPlan`` of every key
    the runtime prepared): three parts, each handed to ``compile_part`` (``torch.compile``
    through the graph runner; None: run as they are), and a Python loop over the layers
    between them::

        h, cos, sin, ring_index = begin(slots)
        h, normed = layer(weights[l], cache.layers[l], ring_index[l], h, cos, sin, normed,
                          plan.path, plan.attention_launch[l])          for l = 0 .. L - 1
        choose(slots, h, mode)

    Every tensor and module of a layer reaches ``layer`` as an argument (no layer index inside),
    so the compiler traces and compiles one layer, not L identical ones, and the same compiled
    code runs every layer: a graph of all 32 layers took 11-16 s per plan from a warm compile
    cache on the H100, and from a warm cache on the CPU 5.0-5.7 s against 0.3-0.4 s for one
    layer (``perf/NOTES.md``, "One compiled layer"). Under CUDA graphs the loop runs at capture
    only: a replay has no Python.

    Compiles are few: the batch reaches every part as dim 0 of its tensors, which each part
    names to ``compile_part`` (``batched``: marked dynamic for ``B >= 2`` when it compiles), so
    one compiled part serves every bucket with the same linear path (a size of 1 is always
    specialized: batch 1 is its own): the plan reaches ``layer`` as its ``DecodePath`` (the
    path's flags, whose values name the compiled variant, and the launches as CPU tensors,
    inputs like the others), so that no choice is taken from a shape inside it. ``layer``
    does not see the mode, and ``begin`` sees neither the mode nor the plan. ``layer``
    compiles once per path, or once per kind of layer where the path hands the input norm on
    (``split_norm``: the first layer takes none, the last hands none on); a pyramid budget's
    capacities, which differ from layer to layer, become a symbolic size at the second layer
    (one compile more). Each part is a method, so that each has a compile cache of its own
    (``torch.compile`` of a ``functools.partial`` runs through one wrapper frame that every
    partial shares).
    """

    # Each part's arguments whose dim 0 is the batch (``compile_part``'s ``batched``).
    batched = {"begin": ("slots",), "layer": ("ring_index", "h", "cos", "sin", "normed"),
               "choose": ("slots", "h")}

    def __init__(self, adapter, cache: StaticKVCache, state: SlotState,
                 compile_part: Optional[Callable[..., Callable]],
                 plans: Dict[Tuple[int, str], StepPlan]):
        self.adapter, self.cache, self.state, self.plans = adapter, cache, state, plans
        self.layers = [(adapter.layer_weights(i), kv) for i, kv in enumerate(cache.layers)]
        parts = (self.begin, self.layer, self.choose)
        if compile_part is not None:
            parts = tuple(compile_part(part, batched=self.batched[part.__name__])
                          for part in parts)
        self._begin, self._layer, self._choose = parts

    def __call__(self, slots: torch.Tensor, mode: str) -> None:
        plan = self.plan(slots.shape[0], mode)
        h, cos, sin, ring_index = self._begin(slots)
        unsplit = self._unsplit(plan)
        normed: Optional[tuple] = None  # the next input norm's share done by the launch before
        for (weights, kv), ring, attend in zip(self.layers, ring_index.unbind(0),
                                               plan.attention_launch):
            h, normed = self._layer(unsplit(weights), kv, ring, h, cos, sin, normed, plan.path,
                                    attend)
        self._choose(slots, h, mode)

    def plan(self, bucket: int, mode: str) -> StepPlan:
        """The plan of ``(bucket, mode)``, which the runtime built when it prepared it."""
        plan = self.plans.get((bucket, mode))
        if plan is None:
            raise RuntimeError(f"step: expected a plan of bucket {bucket}, mode {mode!r} "
                               f"(SlotRuntime.prepare builds it), got none")
        return plan

    @staticmethod
    def _unsplit(plan: StepPlan) -> Callable:
        """How this step hands each layer its weights: as they are where the plan splits the
        norm, else without ``next_norm`` (never read there), so that the last layer is the same
        kind of call as the others: one compiled variant per path instead of two."""
        if plan.path.split_norm:
            return lambda weights: weights
        return lambda weights: weights._replace(next_norm=None)

    def begin(self, slots: torch.Tensor) -> tuple:
        """The step's start for the slots ``[0, B)``: each slot's token embedded, RoPE at its
        logical position, and every layer's flushes and counters at once (live slots only;
        each layer then only writes its new k/v).

        slots: ``state.active[:B]``. Returns ``h (B, 1, hidden)``, ``cos, sin (B, 1, D)`` and
        ``ring_index (L, B)`` int32 (``ops.cache_begin_step``).
        """
        a, st, batch = self.adapter, self.state, slots.shape[0]
        rows = slice(0, batch)
        live = slots & ~st.done[rows]
        h = a.embed(st.tokens[rows, None])                             # (B, 1, hidden)
        cos, sin = a.rope(h, st.positions[rows, None])                 # (B, 1, D)
        return h, cos, sin, ops.cache_begin_step(self.cache.layout, batch, live)

    def layer(self, weights, kv, ring_index: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, normed: Optional[tuple], path, attend: torch.Tensor) -> tuple:
        """One layer of the step, the same code for every layer (no layer index in it).

        weights: the layer's ``adapter.layer_weights``; kv: its ``cache.layers`` buffers (the
        ring written for live slots only); ring_index ``(B,)`` int32: its row of ``begin``'s;
        h ``(B, 1, hidden)``; normed: what the layer before handed on (None for the first);
        path: the plan's ``DecodePath``; attend: this layer's attention launch (the plan's).
        Returns the layer's ``h`` and what it hands on (``adapter.finish_layer_normed``).
        """
        a, batch = self.adapter, h.shape[0]
        # q (B, H_q, 1, D), k/v (B, H_kv, 1, D)
        q, k, v = a.qkv(weights, h, cos, sin, normed, path)
        # Views into the q/k/v projection's output, read in place by both ops (a copy would be
        # one more kernel per tensor and layer).
        ops.cache_write_ring(k[:, :, 0], v[:, :, 0], kv.k_ring, kv.v_ring, ring_index)
        o = ops.decode_attention(q[:, :, 0], *kv, a.scale, self.cache.bits,
                                 self.cache.group_size, launch=attend)  # (B, H_q, D)
        return a.finish_layer_normed(weights, h, o.reshape(batch, 1, -1), path)

    def choose(self, slots: torch.Tensor, h: torch.Tensor, mode: str) -> None:
        """The step's end: the logits of the last layer's ``h (B, 1, hidden)`` (norm, lm_head:
        ``(B, V)`` fp32), each live slot's next token by ``mode``'s rule, recorded at its
        column (``SlotState.choose`` and ``record``)."""
        st = self.state
        rows = slice(0, slots.shape[0])
        live = slots & ~st.done[rows]
        logits = self.adapter.logits(h[:, 0])                          # (B, V) fp32
        st.record(st.choose(logits, rows, mode, live), rows, live)


class RecallDecodeStep(DecodeStep):
    """SpeCache's decode step (``cache.recall`` set): two rows per slot, the token ``T_t`` at
    its position ``p`` and the speculative token ``T'_{t+1}`` (the previous step's guess of
    the next one) at ``p + 1``. Everything per token (embedding, projections, MLP, LM head)
    runs the ``2B`` rows as one batch, so the weights are read once for both rows; the
    attention takes them as ``(B, 2)`` query rows::

        begin: cache_begin_step (T_t's ring row, every layer), embed and RoPE of the 2B rows
        then, on a side stream (CUDA; at capture), every layer's recalled rows for this step
               but the first's from the host copy (minikv::recall_gather, by the indices the
               step before chose), one event per layer: each layer waits for its own gather
               only, and the gathers of later layers overlap the layers before them
        layer: q/k/v; T_t's k/v to its ring row and T'_{t+1}'s to the row after it (the spare
               row when T_t fills the ring; one launch), which ``lens`` does not count (row 1
               sees it, row 0 does not); attention over the low-bit cache with this layer's
               recalled rows in place of theirs (minikv::decode_attention_recall), which writes
               the speculative row's mass into this layer's plane, its lse as the next step's
               mass reference, and gives back the pre-decoding slots' ring token; then, on the
               side stream, T_t's k/v to the host copy (minikv::recall_store)
        rank:  on the side stream, beside choose: every layer's top-k from its mass plane in
               one ranking (recall_topk over ``(B, L, H_kv, T)``: one ``torch.topk`` instead
               of one per layer), the next step's indices; then the first layer's rows for the
               next step, so that its first layer does not wait for a gather (a slot's indices
               change between steps only when it is emptied: -1, no row read)
        choose: row 0's logits -> T_{t+1} by the mode's rule, recorded; row 1's argmax ->
               T'_{t+2} (greedy whatever the mode: it only steers the recall; teacher mode takes
               the forced token instead, see ``choose``)

    Pre-decoding (``state.pre``: a slot's first step after admission): nothing is recalled yet
    (``idx`` -1), both rows feed the first token at its position ``p`` (row 1 sees its own k/v
    twice, which changes no ranking of its mass), row 0's argmax becomes the speculation
    ``T'_2`` and nothing is recorded; ``lens[b, 1]`` is given back, so that the next step feeds
    the first token again, now with its top-k recalled. A slot thus takes one step more than
    its tokens. Unless ``recall_resync`` is "off", the step after a missed guess pre-decodes
    the chosen token the same way (its recall rows the miss's ranking, not -1): one step more
    a miss.
    """

    batched = dict(DecodeStep.batched,
                   layer=("ring_index", "update", "h", "cos", "sin", "normed"), rank=("update",))

    def __init__(self, adapter, cache: StaticKVCache, state: SlotState,
                 compile_part: Optional[Callable[..., Callable]],
                 plans: Dict[Tuple[int, str], StepPlan]):
        super().__init__(adapter, cache, state, compile_part, plans)
        self.recall = cache.recall
        self.layers = [(w, kv, rec, store) for (w, kv), rec, store
                       in zip(self.layers, self.recall.layers, self.recall.stores)]
        cuda = cache.device.type == "cuda"
        self._side = torch.cuda.Stream(device=cache.device) if cuda else None
        self._rank = (self.rank if compile_part is None
                      else compile_part(self.rank, batched=self.batched["rank"]))

    def __call__(self, slots: torch.Tensor, mode: str) -> None:
        batch = slots.shape[0]
        plan = self.plan(batch, mode)
        h, cos, sin, ring_index, update = self._begin(slots)
        main, side = torch.cuda.current_stream() if self._side else None, self._side
        # per layer: an event on the side stream (None without one); the first layer's rows
        # were gathered at the end of the step before
        gathered = [None]
        if side is not None:
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _, _, rec, store in self.layers[1:]:
                ops.recall_gather(store, rec.idx[:batch], rec.k, rec.v)
                gathered.append(side.record_event() if side is not None else None)
        normed: Optional[tuple] = None
        unsplit = self._unsplit(plan)
        for (weights, kv, rec, store), ring, done, attend in zip(
                self.layers, ring_index.unbind(0), gathered, plan.attention_launch):
            if done is not None:
                main.wait_event(done)
            h, normed = self._layer(unsplit(weights), kv, rec, self.recall.mass, ring, update, h,
                                    cos, sin, normed, plan.path, attend)
            if side is not None:
                side.wait_stream(main)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                ops.recall_store(store, kv.k_ring, kv.v_ring, kv.lens, ring)
        if side is not None:  # the stores done; the side stream then ranks beside the LM head
            main.wait_stream(side)
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self._rank(update, self.recall.mass, self.recall.idx)
            _, _, rec, store = self.layers[0]
            ops.recall_gather(store, rec.idx[:batch], rec.k, rec.v)
        self._choose(slots, h, mode)
        if side is not None:
            main.wait_stream(side)

    def begin(self, slots: torch.Tensor) -> tuple:
        """``DecodeStep.begin`` for the two rows of each slot: ``h (2B, 1, hidden)``, ``cos, sin
        (2B, 1, D)`` (rows ``2b``, ``2b + 1``: slot b's token and speculation), ``ring_index
        (L, B)`` int32, and ``update (B,)`` int32: -1 for the slots that are not live, 1 for
        those that pre-decode (their token is given back after the attention), else 0."""
        a, st, batch = self.adapter, self.state, slots.shape[0]
        rows = slice(0, batch)
        live = slots & ~st.done[rows]
        pre = st.pre[rows]
        tokens = torch.stack([st.tokens[rows], st.spec[rows]], dim=1)         # (B, 2)
        pos = st.positions[rows]
        positions = torch.stack([pos, pos + (~pre).long()], dim=1)             # (B, 2)
        h = a.embed(tokens.view(-1, 1))                                        # (2B, 1, hidden)
        cos, sin = a.rope(h, positions.view(-1, 1))                            # (2B, 1, D)
        ring_index = ops.cache_begin_step(self.cache.layout, batch, live)
        return h, cos, sin, ring_index, torch.where(live, pre.int(), -1)

    def layer(self, weights, kv, rec, mass: torch.Tensor, ring_index: torch.Tensor,
              update: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              normed: Optional[tuple], path, attend: torch.Tensor) -> tuple:
        """One layer of the two-row step (the same code for every layer). rec: the layer's
        ``RecallLayer``; mass: the ``(Bmax, L, H_kv, T)`` buffer (this layer writes its plane);
        update ``(B,)`` int32 from ``begin``; the rest as ``DecodeStep.layer``, with ``2B`` rows."""
        a, n_rows = self.adapter, h.shape[0]
        batch = n_rows // 2
        # q (2B, H_q, 1, D), k/v (2B, H_kv, 1, D)
        q, k, v = a.qkv(weights, h, cos, sin, normed, path)
        q2 = q[:, :, 0].unflatten(0, (batch, 2))                               # (B, 2, H_q, D)
        k2, v2 = k[:, :, 0].unflatten(0, (batch, 2)), v[:, :, 0].unflatten(0, (batch, 2))
        ops.cache_write_ring(k2, v2, kv.k_ring, kv.v_ring, ring_index)  # rows i and i + 1
        o = ops.decode_attention_recall(q2, *kv, rec.k, rec.v, rec.idx[:batch], rec.lse_ref,
                                        mass, rec.layer, update, a.scale, self.cache.bits,
                                        self.cache.group_size, launch=attend)
        return a.finish_layer_normed(weights, h, o.reshape(n_rows, 1, -1), path)

    def rank(self, update: torch.Tensor, mass: torch.Tensor, idx: torch.Tensor) -> None:
        """Every layer's next recall: the top-k of each (slot, layer, KV head)'s mass, written
        to ``idx (L, Bmax, H_kv, K)`` for the live slots (``update (B,)`` from ``begin``: >= 0).
        On the side stream, beside ``choose``: it reads only the mass, which the layers have
        written, and ``choose`` does not read ``idx`` (H200, 8B shape, 8 x 4k: 6.06 -> 6.00 ms
        a step against ranking before the LM head on the main stream)."""
        batch = update.shape[0]
        top = ops.recall_topk(mass[:batch], idx.shape[3], self.recall.block)  # (B, L, H_kv, K)
        idx[:, :batch] = torch.where((update >= 0)[None, :, None, None], top.transpose(0, 1),
                                     idx[:, :batch])

    def choose(self, slots: torch.Tensor, h: torch.Tensor, mode: str) -> None:
        """Row 0 of each slot: its next token by ``mode`` (recorded unless it pre-decodes); row
        1 (row 0 when pre-decoding): the next speculation, greedy. Teacher mode speculates the
        forced token the next step feeds after the one it feeds: what greedy generation's
        speculation is whenever the step before guessed right (its row 1 runs the token row 0
        will choose), so that perplexity measures the cache, not a guess of a text the model
        would not have written. With ``recall_resync`` (``"greedy"``: greedy slots;
        ``"always"``: sampled ones too), a slot whose guess missed pre-decodes its chosen token
        next."""
        st = self.state
        batch = slots.shape[0]
        rows = slice(0, batch)
        live = slots & ~st.done[rows]
        pre = st.pre[rows]
        real = live & ~pre
        resync = self.recall.resync != "off" and mode != "teacher"  # (teacher's never miss)
        guessed = st.spec[rows].clone() if resync else None  # what row 1 fed: a guess of `chosen`
        logits = self.adapter.logits(h[:, 0]).view(batch, 2, -1)             # (B, 2, V) fp32
        chosen = st.choose(logits[:, 0], rows, mode, real)
        st.record(chosen, rows, real)
        if mode == "teacher":  # (count has moved on for the slots that recorded)
            col = st.count[rows].clamp(max=st.max_new_tokens - 1)[:, None]
            spec = st.forced[rows].gather(1, col)[:, 0]
        else:
            spec = argmax_rows(torch.where(pre[:, None], logits[:, 0], logits[:, 1]))
        st.spec[rows] = torch.where(live, spec, st.spec[rows])
        st.pre[rows] = pre & ~live
        if resync:
            # a miss: row 1's guess of the next token was conditioned on another token than
            # the one chosen, so the next step pre-decodes the chosen one in both rows
            miss = real & ~st.done[rows] & (chosen != guessed)
            if self.recall.resync == "greedy":
                miss = miss & st.greedy[rows]  # a sampling batch's drawn slots keep their lag
            st.pre[rows] = st.pre[rows] | miss
            st.spec[rows] = torch.where(miss, chosen, st.spec[rows])

