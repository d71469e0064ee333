"""minikv::cache_write_prefill and the decode step pair minikv::cache_begin_step (every layer)
+ minikv::cache_write_ring (one layer).

The semantics are checked against a Python model that keeps every slot's full token list and
derives what each buffer must hold from it: the region = the quantization of the slot's first
lens[b, 0] tokens in order, the ring = the rows last written, everything else untouched.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

from minikv_compile.ops import (CacheLayout, cache_begin_step, cache_write_prefill,
                                cache_write_ring)
from minikv_compile.ops import cache_update
from minikv_compile.ops.cache_update import (_cache_begin_step_triton, _cache_write_ring_triton,
                                             cache_begin_step_ref, cache_write_ring_ref)
from minikv_compile.ops.quant import (dequantize_keys_ref, dequantize_values_ref,
                                      quantize_keys_ref, quantize_values_ref)
from aot import compile_for_sm90

NAMES = ("k_cache", "k_scale", "k_zero", "v_cache", "v_scale", "v_zero", "k_ring", "v_ring",
         "lens")


def make_cache(Bmax, H, T_cap, R, D, bits, G, dtype, device="cpu", seed=0):
    """One layer's buffers, filled with garbage so that any stray write shows."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt):
        return torch.randn(shape, generator=g).to(dt).to(device)

    def codes(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32).to(device)

    if bits == 16:
        empty = torch.empty(0, dtype=torch.float16, device=device)
        region = [rnd(Bmax, H, T_cap, D, dt=dtype), empty, empty,
                  rnd(Bmax, H, T_cap, D, dt=dtype), empty, empty]
    else:
        P = 32 // bits
        region = [codes(Bmax, H, T_cap // P, D), rnd(Bmax, H, T_cap // G, D, dt=torch.float16),
                  rnd(Bmax, H, T_cap // G, D, dt=torch.float16), codes(Bmax, H, T_cap, D // P),
                  rnd(Bmax, H, T_cap, D // min(G, D), dt=torch.float16),
                  rnd(Bmax, H, T_cap, D // min(G, D), dt=torch.float16)]
    rings = [rnd(Bmax, H, R, D, dt=dtype), rnd(Bmax, H, R, D, dt=dtype)]
    lens = torch.zeros(Bmax, 2, dtype=torch.int32, device=device)
    return region + rings + [lens]


def live_slots(batch, device="cpu", dead=()):
    live = torch.ones(batch, dtype=torch.bool, device=device)
    for slot in dead:
        live[slot] = False  # a fill, not a copy from the host: allowed inside a graph capture
    return live


def step_all_layers(layers, layout, news, batch, bits, G, impl="op", dead=()):
    """One decode step of every layer through the pair: begin_step, then each layer's ring write
    (``impl``: the registered ops, the references, or the Triton launchers); returns ring_index."""
    live = live_slots(batch, layers[0][8].device, dead)
    if impl == "triton":
        ring_index = _cache_begin_step_triton(layout.table, layout.table_host, *layout.columns(),
                                              live, batch, bits, G)
    elif impl == "ref":
        ring_index = cache_begin_step_ref(None, None, *[list(c) for c in zip(*layers)], live,
                                          batch, bits, G)
    else:
        ring_index = cache_begin_step(layout, batch, live)
    write = {"op": cache_write_ring, "ref": cache_write_ring_ref,
             "triton": _cache_write_ring_triton}[impl]
    for bufs, (k_new, v_new), index in zip(layers, news, ring_index):
        write(k_new, v_new, bufs[6], bufs[7], index)
    return ring_index


def append(k_new, v_new, *bufs_bits_g, impl="op"):
    """One layer's decode step (every slot of ``k_new``'s batch live) through the pair."""
    *bufs, bits, G = bufs_bits_g
    layout = CacheLayout([bufs], bits, G) if impl != "ref" else None
    step_all_layers([bufs], layout, [(k_new, v_new)], k_new.shape[0], bits, G, impl)


def clone_all(bufs):
    return [t.clone() for t in bufs]


def assert_buffers_equal(got, want, where=""):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a, b), f"{where}: {name} differs"


class SlotModel:
    """What the cache must hold, derived from each slot's full token list."""

    def __init__(self, initial, R, bits, G):
        self.initial = clone_all(initial)
        self.rings = [initial[6].clone(), initial[7].clone()]   # rows as last written
        self.R, self.bits, self.G = R, bits, G
        self.tokens = {}                                         # slot -> [(k, v) (H, D)]
        self.n_quant = {}

    def prefill(self, slot, k_sel, v_sel, ring_tokens=None):
        n = k_sel.shape[1]
        self.tokens[slot] = [(k_sel[:, i], v_sel[:, i]) for i in range(n)]
        self.n_quant[slot] = n // self.G * self.G if ring_tokens is None else n - ring_tokens
        for i in range(n - self.n_quant[slot]):
            self._write_ring(slot, i, *self.tokens[slot][self.n_quant[slot] + i])

    def append(self, k_new, v_new):
        for b in range(k_new.shape[0]):
            if self.n_ring(b) == self.R:       # the ring filled up last step: flush it now
                self.n_quant[b] += self.R
            self._write_ring(b, self.n_ring(b), k_new[b], v_new[b])
            self.tokens[b].append((k_new[b], v_new[b]))

    def n_ring(self, b):
        return len(self.tokens[b]) - self.n_quant[b]

    def _write_ring(self, b, i, k, v):
        self.rings[0][b, :, i] = k
        self.rings[1][b, :, i] = v

    def check(self, bufs, where=""):
        want = clone_all(self.initial)
        want[6], want[7] = self.rings
        bits, G = self.bits, self.G
        for b, toks in self.tokens.items():
            nq = self.n_quant[b]
            want[8][b] = torch.tensor([nq, len(toks) - nq])
            if nq == 0:
                continue
            k = torch.stack([t[0] for t in toks[:nq]], dim=1)[None]   # (1, H, nq, D)
            v = torch.stack([t[1] for t in toks[:nq]], dim=1)[None]
            if bits == 16:
                want[0][b, :, :nq], want[3][b, :, :nq] = k[0], v[0]
                continue
            P = 32 // bits
            qk = quantize_keys_ref(k, bits, G)                       # (1, H, nq/P or nq/G, D)
            GV = min(G, v.shape[-1])                 # a value group: G channels, or the head
            qv = quantize_values_ref(v, bits, GV)                    # (1, H, nq, D/P or D/GV)
            for i in range(3):
                want[i][b, :, : (nq // P if i == 0 else nq // G)] = qk[i][0]
                want[3 + i][b, :, :nq] = qv[i][0]
            # The region, read back, is the quantize/dequantize round trip of these tokens.
            got_k = dequantize_keys_ref(bufs[0][b:b + 1, :, :nq // P],
                                        *(t[b:b + 1, :, :nq // G] for t in bufs[1:3]), bits, G,
                                        torch.float32)
            got_v = dequantize_values_ref(*(t[b:b + 1, :, :nq] for t in bufs[3:6]), bits, GV,
                                          torch.float32)
            assert torch.equal(got_k, dequantize_keys_ref(*qk, bits, G, torch.float32)), where
            assert torch.equal(got_v, dequantize_values_ref(*qv, bits, GV, torch.float32)), where
        assert_buffers_equal(bufs, want, where)


def new_tokens(B, H, D, dtype, g):
    return (torch.randn(B, H, D, generator=g).to(dtype),
            torch.randn(B, H, D, generator=g).to(dtype))


# ----------------------------------------------------------------------------------------------
# Semantics, step by step (the registered ops; on CPU they run the reference)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,G,R,T_cap,final", [
    (2, 16, 32, 160, [[112, 4], [96, 9], [128, 19]]),
    (4, 16, 32, 160, [[112, 4], [96, 9], [128, 19]]),
    (16, 16, 32, 160, [[112, 4], [96, 9], [128, 19]]),
    # key groups of 64 tokens over heads of 32 channels: value groups of 32 (the whole head)
    (2, 64, 64, 192, [[64, 52], [64, 41], [128, 19]]),
])
def test_append_matches_token_model(bits, dtype, G, R, T_cap, final):
    # 3 active slots of 4; prefill leaves 16, 5, 47 tokens -> rings of 0, 5, 15 (R = 32, G = 16),
    # so the three slots flush at different steps. Slot 3 must never change.
    Bmax, B, H, D = 4, 3, 3, 32
    bufs = make_cache(Bmax, H, T_cap, R, D, bits, G, dtype)
    model = SlotModel(bufs, R, bits, G)
    g = torch.Generator().manual_seed(1)
    for slot, n in enumerate((16, 5, 47)):
        k_sel, v_sel = (torch.randn(H, n, D, generator=g).to(dtype) for _ in range(2))
        cache_write_prefill(k_sel, v_sel, slot, bufs, bits, G)
        model.prefill(slot, k_sel, v_sel)
    model.check(bufs, "after prefill")
    assert bufs[8][:B].tolist() == [[n // G * G, n % G] for n in (16, 5, 47)]
    for step in range(100):
        k_new, v_new = new_tokens(B, H, D, dtype, g)
        append(k_new, v_new, *bufs, bits, G)
        model.append(k_new, v_new)
        model.check(bufs, f"step {step}")
    assert bufs[8][:B].tolist() == final


@pytest.mark.parametrize("bits", [2, 16])
def test_full_ring_without_room_is_left_alone(bits):
    Bmax, H, D, R, G, T_cap = 2, 2, 32, 32, 16, 64
    bufs = make_cache(Bmax, H, T_cap, R, D, bits, G, torch.float16)
    bufs[8].copy_(torch.tensor([[T_cap - 16, R], [T_cap - R, R]]))  # slot 0 full, slot 1 fits
    before = clone_all(bufs)
    k_new, v_new = new_tokens(2, H, D, torch.float16, torch.Generator().manual_seed(0))
    append(k_new, v_new, *bufs, bits, G)
    assert bufs[8].tolist() == [[T_cap - 16, R], [T_cap, 1]]
    for name, a, b in zip(NAMES, bufs, before):
        if a.numel():
            assert torch.equal(a[0], b[0]), name   # slot 0 untouched


# ----------------------------------------------------------------------------------------------
# Triton launcher (interpreter on CPU) vs reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("bits,D,G", [(b, D, G) for b in (2, 4, 16)
                                       for D, G in [(64, 16), (64, 32), (16, 16), (80, 16)]
                                       if not (b == 4 and D == 80)]  # D=80 once is enough
                         + [(1, 64, 32), (2, 16, 32), (4, 16, 32)])  # (value groups of 16)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_matches_reference(bits, dtype, D, G):
    Bmax, B, H, R, T_cap = 4, 3, 3, 32, 96
    ref = make_cache(Bmax, H, T_cap, R, D, bits, G, dtype)
    # Slot 0 fills its ring and flushes at step 2, slot 1 flushes at step 0 into a non-empty
    # region, slot 2 never flushes.
    ref[8][:B] = torch.tensor([[0, R - 2], [32, R], [64, 3]], dtype=torch.int32)
    tri = clone_all(ref)
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        k_new, v_new = new_tokens(B, H, D, dtype, g)
        if step == 3:
            v_new = v_new.transpose(0, 1).contiguous().transpose(0, 1)  # strided input
        append(k_new, v_new, *ref, bits, G, impl="ref")
        append(k_new, v_new, *tri, bits, G, impl="triton")
        assert_buffers_equal(tri, ref, f"step {step}")
    assert ref[8][:B].tolist() == [[32, 2], [64, 4], [64, 7]]


@pytest.mark.interpret
@pytest.mark.parametrize("D,G,tile,chunks", [
    (64, 16, 2048, 4),    # one flush program per ring group of 16 tokens (R / G = 4)
    (64, 16, 256, 16),    # each group split into 4 key channel blocks / 4 value-token slices
    (80, 16, 256, 32),    # D = 80 pads to 128 channels: key blocks 5..7 of a group are all masked
    (64, 64, 256, 16),    # one group of 64 tokens, split 16 ways (4 channels / 4 value tokens)
])
@pytest.mark.parametrize("bits", [2, 4, 16])
def test_triton_flush_spans_programs(bits, D, G, tile, chunks, monkeypatch):
    monkeypatch.setattr(cache_update, "_TILE_ELEMENTS", tile)
    # H = 3: with D = 80 and the small tile the append program loops over 2 head blocks of 2.
    Bmax, H, R, T_cap = 4, 3, 64, 128
    if bits < 16:
        assert cache_update._flush_tiles(R, D, bits, G)[0] == chunks
    ref = make_cache(Bmax, H, T_cap, R, D, bits, G, torch.float16)
    # Slot 0 flushes at step 0 into an empty region, slot 1 at step 1 into a non-empty one, slot 2
    # never flushes, slot 3 has a full ring and no room (never written).
    ref[8].copy_(torch.tensor([[0, R], [64, R - 1], [0, 3], [T_cap, R]]))
    tri = clone_all(ref)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        k_new, v_new = new_tokens(Bmax, H, D, torch.float16, g)
        append(k_new, v_new, *ref, bits, G, impl="ref")
        append(k_new, v_new, *tri, bits, G, impl="triton")
        assert_buffers_equal(tri, ref, f"step {step}")
    assert ref[8].tolist() == [[64, 3], [128, 2], [0, 6], [T_cap, R]]


@pytest.mark.interpret
def test_triton_full_ring_without_room():
    bufs = make_cache(2, 2, 64, 32, 32, 2, 16, torch.float16)
    bufs[8].copy_(torch.tensor([[48, 32], [32, 32]]))
    ref = clone_all(bufs)
    k_new, v_new = new_tokens(2, 2, 32, torch.float16, torch.Generator().manual_seed(0))
    append(k_new, v_new, *ref, 2, 16, impl="ref")
    append(k_new, v_new, *bufs, 2, 16, impl="triton")
    assert_buffers_equal(bufs, ref)
    assert bufs[8].tolist() == [[48, 32], [64, 1]]


# ----------------------------------------------------------------------------------------------
# All layers at once: cache_begin_step, then cache_write_ring per layer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_begin_step_matches_token_model(bits):
    # Three layers of different capacities (as under the pyramid policy), each slot with its own
    # prefill length per layer, so rings fill at different steps in every layer and slot; slot 3
    # of 4 is outside the batch and must never change.
    Bmax, B, H, D, R, G = 4, 3, 2, 32, 32, 16
    caps, dtype = (96, 160, 128), torch.float16
    prefill = ((16, 5, 47), (40, 0, 31), (3, 64, 17))
    layers = [make_cache(Bmax, H, cap, R, D, bits, G, dtype, seed=i) for i, cap in enumerate(caps)]
    models = [SlotModel(bufs, R, bits, G) for bufs in layers]
    g = torch.Generator().manual_seed(1)
    for bufs, model, lengths in zip(layers, models, prefill):
        for slot, n in enumerate(lengths):
            k_sel, v_sel = (torch.randn(H, n, D, generator=g).to(dtype) for _ in range(2))
            cache_write_prefill(k_sel, v_sel, slot, bufs, bits, G)
            model.prefill(slot, k_sel, v_sel)
    layout = CacheLayout(layers, bits, G)
    for step in range(40):   # every ring reaches R = 32 once
        news = [new_tokens(B, H, D, dtype, g) for _ in layers]
        want = [[m.n_ring(b) % R for b in range(B)] for m in models]   # row after any flush
        ring_index = step_all_layers(layers, layout, news, B, bits, G)
        assert ring_index.dtype == torch.int32 and ring_index.tolist() == want, f"step {step}"
        for layer, (bufs, model, (k_new, v_new)) in enumerate(zip(layers, models, news)):
            model.append(k_new, v_new)
            model.check(bufs, f"step {step} layer {layer}")


def test_begin_step_full_ring_without_room():
    Bmax, H, D, R, G, T_cap = 2, 2, 32, 32, 16, 64
    layers = [make_cache(Bmax, H, T_cap, R, D, 2, G, torch.float16, seed=i) for i in range(2)]
    layers[0][8].copy_(torch.tensor([[T_cap - 16, R], [T_cap - R, R]]))  # slot 0 has no room
    layers[1][8].copy_(torch.tensor([[0, 3], [T_cap, R]]))               # slot 1 has no room
    before = [clone_all(bufs) for bufs in layers]
    news = [new_tokens(2, H, D, torch.float16, torch.Generator().manual_seed(i)) for i in range(2)]
    ring_index = step_all_layers(layers, CacheLayout(layers, 2, G), news, 2, 2, G)
    assert ring_index.tolist() == [[-1, 0], [3, -1]]
    assert layers[0][8].tolist() == [[T_cap - 16, R], [T_cap, 1]]
    assert layers[1][8].tolist() == [[0, 4], [T_cap, R]]
    for (bufs, was), slot in zip(zip(layers, before), (0, 1)):
        for name, a, b in zip(NAMES, bufs, was):
            if a.numel():
                assert torch.equal(a[slot], b[slot]), name   # the slot without room: untouched


def _layers_case(bits, D, G, dtype, device="cpu"):
    """Four layers, Bmax = 4, batch 3: full rings (with and without room), a flush into a
    non-empty region, rings that fill during the steps, and slot 3 (outside the batch) full."""
    Bmax, H, R = 4, 3, 32
    caps = (96, 64, 128, 64)
    states = ([[0, R - 2], [32, R], [64, 3], [0, R]],
              [[32, R], [64, R], [0, R - 1], [0, R]],
              [[0, 0], [96, R], [16, R], [32, R]],
              [[48, 5], [0, R], [32, R - 1], [0, R]])
    layers = []
    for i, (cap, state) in enumerate(zip(caps, states)):
        bufs = make_cache(Bmax, H, cap, R, D, bits, G, dtype, device=device, seed=i)
        bufs[8].copy_(torch.tensor(state, dtype=torch.int32))
        layers.append(bufs)
    return layers, 3, H


@pytest.mark.interpret
@pytest.mark.parametrize("programs,pairs_per_tile", [(8, 1024), (1, 1024), (3, 4)])
@pytest.mark.parametrize("bits,D,G", [(2, 64, 16), (4, 64, 32), (16, 64, 16), (2, 80, 16)])
def test_triton_begin_step_matches_reference(bits, D, G, programs, pairs_per_tile, monkeypatch):
    # On the CPU the grid has `programs` programs (8 per "SM", one SM), so each takes several work
    # items; tiles of 4 (layer, slot) pairs make the full rings of a step span several tiles.
    monkeypatch.setattr(cache_update, "_FLUSH_PROGRAMS_PER_SM", programs)
    monkeypatch.setattr(cache_update, "_PAIRS_PER_TILE", pairs_per_tile)
    dtype = torch.bfloat16
    tri, B, H = _layers_case(bits, D, G, dtype)
    ref = [clone_all(bufs) for bufs in tri]
    layout = CacheLayout(tri, bits, G)
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        news = [new_tokens(B, H, D, dtype, g) for _ in tri]
        if step == 2:   # strided input, as the q/k/v projection's views
            news[0] = tuple(t.transpose(0, 1).contiguous().transpose(0, 1) for t in news[0])
        want = [[int(bufs[8][b, 1]) % 32 if not (bufs[8][b, 1] == 32 and
                                               bufs[8][b, 0] + 32 > bufs[3].shape[2]) else -1
                 for b in range(B)] for bufs in ref]
        ring_index = step_all_layers(tri, layout, news, B, bits, G, impl="triton")
        assert ring_index.tolist() == want, f"step {step}"
        for layer, (bufs, (k_new, v_new)) in enumerate(zip(ref, news)):
            append(k_new, v_new, *bufs, bits, G, impl="ref")
            assert_buffers_equal(tri[layer], bufs, f"step {step} layer {layer}")


def _with_spare_row(bufs):
    """The same layer with rings of R + 1 rows: the first R as given, the spare row noise."""
    out = clone_all(bufs)
    for i in (6, 7):
        ring = bufs[i]
        spare = torch.randn(*ring.shape[:2], 1, ring.shape[3]).to(ring.dtype)
        out[i] = torch.cat([ring, spare.to(ring.device)], dim=2).contiguous()
    return out


@pytest.mark.interpret
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("bits", [2, 4])
def test_spare_ring_row_changes_nothing_counted(bits, impl):
    # A ring of R + 1 rows (SpeCache's speculative token) flushes R tokens, as a ring of R rows
    # does: over steps that flush full rings (with and without room), the regions, counters
    # and ring rows [0, R) equal those of the same cache without the spare row; a token written
    # to the spare row (ring_index + 1 = R) is never flushed.
    plain, B, H = _layers_case(bits, 64, 16, torch.float16)
    spare = [_with_spare_row(bufs) for bufs in plain]
    layouts = [CacheLayout(c, bits, 16) if impl == "triton" else None for c in (plain, spare)]
    assert layouts[0] is None or layouts[1].ring == layouts[0].ring == 32
    g = torch.Generator().manual_seed(5)
    # 35 steps: _layers_case's rings fill (a token in the spare row) at steps 0, 1, 26, 28 and
    # 31-33 and flush with room at 0-2, 29 and 32-34; later steps only find full rings with no
    # room again (40 steps before: 5 more Triton-interpreter steps of nothing new)
    for step in range(35):
        news = [new_tokens(B, H, 64, torch.float16, g) for _ in plain]
        index = [step_all_layers(c, lay, news, B, bits, 16, impl)
                 for c, lay in zip((plain, spare), layouts)]
        assert torch.equal(*index), step
        # the speculative token, one row on: the same in both rings where the plain one has
        # the row, the spare row's alone when the token filled the ring
        for p, q, idx in zip(plain, spare, index[1]):
            for b, i in enumerate(idx.tolist()):
                if i >= 0:
                    q[6][b, :, i + 1] = torch.randn(H, 64, generator=g).half()
                    if i + 1 < 32:
                        p[6][b, :, i + 1] = q[6][b, :, i + 1]
        for layer, (p, q) in enumerate(zip(plain, spare)):
            q_counted = list(q[:6]) + [q[6][:, :, :32], q[7][:, :, :32], q[8]]
            assert_buffers_equal(q_counted, p, f"step {step}, layer {layer}")


_AOT_BODY = """
from minikv_compile.ops import cache_update as cu

for bits, rows in ((2, 128), (2, 129), (16, 128)):  # 129: a ring with a spare row
    chunks, flush = cu._flush_constants(128, 128, bits, 16)
    build(cu._flush_layers_kernel,
          {"table": "*i64", "live": "*i1", "L": "i32", "batch": "i32", "H": "i32", "D": "i32"},
          dict(flush, ROWS=rows, CHUNKS=chunks, RING_DT=tl.bfloat16,
               CODE_DT=tl.bfloat16 if bits == 16 else tl.int32, BLOCK_P=256, PDL=True))
build(cu._commit_kernel, {"table": "*i64", "live": "*i1", "ring_index": "*i32", "batch": "i32"},
      dict(RING=128, BLOCK_B=8, PDL=True))
build(cu._write_ring_kernel,
      dict({"k_new": "*bf16", "v_new": "*bf16", "k_ring": "*bf16", "v_ring": "*bf16",
            "ring_index": "*i32", "H": "i32", "D": "i32"},
           **{f"stride_{t}{d}": "i32" for t in "kv" for d in "bshd"}),
      dict(RING=128, PDL=True, **cu._write_constants(8, 128)))
"""


def test_all_layer_kernels_compile_for_sm90():
    # The all-layer kernels for an H100/H200, without a GPU (tests/aot.py says why).
    compile_for_sm90(_AOT_BODY)


@pytest.mark.interpret
def test_triton_begin_step_with_copies_of_the_buffers():
    # Functionalization (AOT tracing, opcheck, or a compiler that cannot write in place) hands
    # the op copies of the buffers with the layout's table: the launch must write the tensors
    # it was given, and nothing else.
    tri, B, H = _layers_case(2, 32, 16, torch.float16)
    layout = CacheLayout(tri, 2, 16)
    copies, ref = [clone_all(bufs) for bufs in tri], [clone_all(bufs) for bufs in tri]
    untouched = [clone_all(bufs) for bufs in tri]
    news = [new_tokens(B, H, 32, torch.float16, torch.Generator().manual_seed(i))
            for i in range(len(tri))]
    index = _cache_begin_step_triton(layout.table, layout.table_host,
                                     *[list(c) for c in zip(*copies)], live_slots(B), B, 2, 16)
    assert torch.equal(index, step_all_layers(ref, None, news, B, 2, 16, impl="ref"))
    for layer, (bufs, (k_new, v_new)) in enumerate(zip(copies, news)):
        _cache_write_ring_triton(k_new, v_new, bufs[6], bufs[7], index[layer])
        assert_buffers_equal(bufs, ref[layer], f"copy of layer {layer}")
        assert_buffers_equal(tri[layer], untouched[layer], f"layer {layer}")


def test_slots_that_are_not_live_are_not_touched():
    # The runtime steps every slot of a bucket; a free or finished slot is not live: its
    # counters, ring and region stay as they are, even with a full ring, and it gets no row.
    tri, B, H = _layers_case(2, 32, 16, torch.float16)
    ref = [clone_all(bufs) for bufs in tri]
    news = [new_tokens(B, H, 32, torch.float16, torch.Generator().manual_seed(i))
            for i in range(len(tri))]
    ring_index = step_all_layers(tri, CacheLayout(tri, 2, 16), news, B, 2, 16, dead=(1,))
    assert (ring_index[:, 1] == -1).all()
    for layer, (bufs, was) in enumerate(zip(tri, ref)):
        for name, a, b in zip(NAMES, bufs, was):
            if a.numel():
                assert torch.equal(a[1], b[1]), f"layer {layer}: {name} of slot 1 changed"
    # and the live slots step as the reference steps them
    assert torch.equal(step_all_layers(ref, None, news, B, 2, 16, impl="ref", dead=(1,)),
                       ring_index)
    for layer, (got, want) in enumerate(zip(tri, ref)):
        assert_buffers_equal(got, want, f"layer {layer}")


def test_begin_step_bad_inputs():
    Bmax, H, D, R, G = 2, 2, 32, 32, 16
    layers = [make_cache(Bmax, H, 64, R, D, 2, G, torch.float16, seed=i) for i in range(2)]
    layout = CacheLayout(layers, 2, G)
    with pytest.raises(ValueError, match="at least one layer"):
        CacheLayout([], 2, G)
    with pytest.raises(ValueError, match=r"layers\[1\]: expected the 9 buffers"):
        CacheLayout([layers[0], layers[1][:8]], 2, G)
    other = make_cache(Bmax, H + 1, 64, R, D, 2, G, torch.float16)
    with pytest.raises(ValueError, match=r"expected one \(Bmax, H, R, D, ring dtype, device\)"):
        CacheLayout([layers[0], other], 2, G)
    with pytest.raises(ValueError, match="bits: expected one of"):
        CacheLayout(layers, 3, G)
    with pytest.raises(ValueError, match="layout: expected a CacheLayout"):
        cache_begin_step(layers, 1, live_slots(1))
    for batch in (0, Bmax + 1, 1.0):
        with pytest.raises(ValueError, match="batch: expected an int in"):
            cache_begin_step(layout, batch, live_slots(1))
    with pytest.raises(ValueError, match="live: expected shape"):
        cache_begin_step(layout, 2, live_slots(1))
    with pytest.raises(ValueError, match="live: expected dtype"):
        cache_begin_step(layout, 1, live_slots(1).int())
    k_new, v_new = new_tokens(2, H, D, torch.float16, torch.Generator().manual_seed(0))
    index = torch.zeros(2, dtype=torch.int32)
    ring = layers[0][6]
    with pytest.raises(ValueError, match="ring_index: expected dtype"):
        cache_write_ring(k_new, v_new, ring, layers[0][7], index.long())
    with pytest.raises(ValueError, match="ring_index: expected shape"):
        cache_write_ring(k_new, v_new, ring, layers[0][7], index[:1])
    with pytest.raises(ValueError, match="k_new: expected dtype"):
        cache_write_ring(k_new.float(), v_new, ring, layers[0][7], index)
    with pytest.raises(ValueError, match="v_ring: expected shape"):
        cache_write_ring(k_new, v_new, ring, ring[:, :1].contiguous(), index)
    with pytest.raises(ValueError, match="whole cache buffer"):
        big = torch.zeros(2 * Bmax, H, R, D, dtype=torch.float16)
        cache_write_ring(k_new, v_new, big[:Bmax], layers[0][7], index)
    with pytest.raises(ValueError, match="batch <= max_batch_size=2"):
        cache_write_ring(torch.cat([k_new] * 2), torch.cat([v_new] * 2), ring, layers[0][7],
                         torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("impl", ["op", "ref", pytest.param("triton", marks=pytest.mark.interpret)])
def test_write_ring_several_tokens_per_slot(impl):
    """(B, S, H, D): slot b's token s to ring row ring_index[b] + s (a ring of R + 1 rows: the
    spare row takes the second token when the first fills the ring); -1 and slots >= B
    untouched. k/v strided as the two-row step hands them (rows 2b and 2b + 1 of a batch)."""
    Bmax, H, D, R, S = 4, 3, 32, 16, 2
    g = torch.Generator().manual_seed(5)
    k_ring, v_ring = (torch.randn(Bmax, H, R + 1, D, generator=g).half() for _ in range(2))
    k_rows, v_rows = (torch.randn(3 * S, H, 2, D, generator=g).half() for _ in range(2))
    k_new, v_new = k_rows[:, :, 0].unflatten(0, (3, S)), v_rows[:, :, 0].unflatten(0, (3, S))
    ring_index = torch.tensor([R - 1, -1, 4], dtype=torch.int32)
    want_k, want_v = k_ring.clone(), v_ring.clone()
    for b, i in enumerate(ring_index.tolist()):
        for t in range(S if i >= 0 else 0):
            want_k[b, :, i + t], want_v[b, :, i + t] = k_new[b, t], v_new[b, t]
    write = {"op": cache_write_ring, "ref": cache_write_ring_ref,
             "triton": _cache_write_ring_triton}[impl]
    write(k_new, v_new, k_ring, v_ring, ring_index)
    assert torch.equal(k_ring, want_k) and torch.equal(v_ring, want_v)


def test_write_ring_several_tokens_bad_inputs():
    k_ring = torch.zeros(2, 3, 4, 8, dtype=torch.float16)
    index = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tokens per slot \(dim 1\) <= ring rows=4"):
        cache_write_ring(*(torch.zeros(2, 5, 3, 8, dtype=torch.float16) for _ in range(2)),
                         k_ring, k_ring.clone(), index)
    with pytest.raises(ValueError, match="k_new: expected shape"):
        cache_write_ring(*(torch.zeros(2, 2, 4, 8, dtype=torch.float16) for _ in range(2)),
                         k_ring, k_ring.clone(), index)
    with pytest.raises(ValueError, match="v_new: expected shape"):
        cache_write_ring(torch.zeros(2, 2, 3, 8, dtype=torch.float16),
                         torch.zeros(2, 3, 8, dtype=torch.float16), k_ring, k_ring.clone(), index)


# ----------------------------------------------------------------------------------------------
# Prefill write
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, ring", [(0, None), (5, None), (16, None), (47, None),
                                     (64 + 15, None),
                                     # more than n % G in the ring: all of a short prompt, or
                                     # the last ring tokens of a longer one
                                     (32, 32), (5, 5), (47, 31), (64 + 15, 31)])
@pytest.mark.parametrize("bits", [2, 4, 16])
def test_write_prefill(bits, n, ring):
    Bmax, H, D, R, G, T_cap = 3, 2, 32, 32, 16, 64
    bufs = make_cache(Bmax, H, T_cap, R, D, bits, G, torch.bfloat16)
    model = SlotModel(bufs, R, bits, G)
    g = torch.Generator().manual_seed(n)
    k_sel, v_sel = (torch.randn(H, n, D, generator=g).to(torch.bfloat16) for _ in range(2))
    cache_write_prefill(k_sel, v_sel, 1, bufs, bits, G, ring)
    model.prefill(1, k_sel, v_sel, ring)
    model.check(bufs)
    t = n % G if ring is None else ring
    assert bufs[8][1].tolist() == [n - t, t]


# ----------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 16])
def test_opcheck_write_prefill(bits):
    Bmax, H, D, R, G, T_cap = 3, 2, 32, 32, 16, 64
    bufs = make_cache(Bmax, H, T_cap, R, D, bits, G, torch.float16)
    k_sel, v_sel = new_tokens(H, 37, D, torch.float16, torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.minikv.cache_write_prefill.default,
                          (k_sel, v_sel, 2, *bufs, bits, G, 37 - 32))


@pytest.mark.parametrize("bits", [2, 16])
def test_opcheck_begin_step(bits):
    layers, B, H = _layers_case(bits, 32, 16, torch.float16)
    layout = CacheLayout(layers, bits, 16)
    torch.library.opcheck(torch.ops.minikv.cache_begin_step.default,
                          (layout.table, layout.table_host, *layout.columns(),
                           live_slots(B, dead=(2,)), B, bits, 16))
    k_new, v_new = new_tokens(B, H, 32, torch.float16, torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.minikv.cache_write_ring.default,
                          (k_new, v_new, layers[0][6], layers[0][7],
                           torch.tensor([0, -1, 5], dtype=torch.int32)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compile_fullgraph_all_layer_steps_across_flush(device):
    layers, B, H = _layers_case(2, 32, 16, torch.float16, device)
    compiled_layers = [clone_all(bufs) for bufs in layers]
    layouts = CacheLayout(layers, 2, 16), CacheLayout(compiled_layers, 2, 16)
    live = live_slots(B, device)

    def step(layout, news):
        ring_index = cache_begin_step(layout, B, live)
        for bufs, (k_new, v_new), index in zip(layout.layers, news, ring_index):
            cache_write_ring(k_new, v_new, bufs[6], bufs[7], index)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for i in range(4):    # flushes at steps 0 and 2
        news = [tuple(t.to(device) for t in new_tokens(B, H, 32, torch.float16, g))
                for _ in layers]
        if i == 0:
            _, (code,) = run_and_get_code(compiled, layouts[1], news)
            # The ops mutate the caller's buffers in place (the kernels reach them through the
            # layout's table): no clone of any buffer.
            assert "minikv.cache_begin_step.default(" in code and "clone" not in code
        else:
            compiled(layouts[1], news)
        step(layouts[0], news)
        for layer, (got, want) in enumerate(zip(compiled_layers, layers)):
            assert_buffers_equal(got, want, f"step {i} layer {layer}")
    assert counter.frame_count == 1, "the step recompiled"


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------


def test_bad_inputs():
    Bmax, H, D, R, G, T_cap = 2, 2, 32, 32, 16, 64
    bufs = make_cache(Bmax, H, T_cap, R, D, 2, G, torch.float16)
    k_new, v_new = new_tokens(2, H, D, torch.float16, torch.Generator().manual_seed(0))

    def append(k=k_new, v=v_new, bits=2, group_size=G, **over):
        b = dict(zip(NAMES, bufs), **over)
        layout = CacheLayout([list(b.values())], bits, group_size)
        cache_write_ring(k, v, b["k_ring"], b["v_ring"],
                         cache_begin_step(layout, Bmax, live_slots(Bmax))[0][: k.shape[0]])

    with pytest.raises(ValueError, match="batch <= max_batch_size=2"):
        append(k=torch.cat([k_new, k_new]), v=torch.cat([v_new, v_new]))
    with pytest.raises(ValueError, match="k_new: expected dtype"):
        append(k=k_new.float())
    with pytest.raises(ValueError, match="v_new: expected shape"):
        append(v=v_new[:1])
    with pytest.raises(ValueError, match="k_new: expected shape"):
        append(k=k_new[:, :1])
    with pytest.raises(ValueError, match="lens: expected dtype"):
        append(lens=bufs[8].long())
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        append(k_cache=torch.zeros(Bmax, H, T_cap // 8, D, dtype=torch.int32))
    with pytest.raises(ValueError, match="v_scale: expected dtype"):
        append(v_scale=bufs[4].float())
    with pytest.raises(ValueError, match="bits: expected one of"):
        append(bits=8)
    with pytest.raises(ValueError, match="group_size: expected one of"):
        append(group_size=8)
    with pytest.raises(ValueError, match="divisible by group_size=64"):
        append(group_size=64)
    with pytest.raises(ValueError, match="whole cache buffer"):
        big = torch.zeros(2 * Bmax, H, R, D, dtype=torch.float16)
        append(k_ring=big[:Bmax])
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        append(bits=16)   # 16 bit needs (Bmax, H, T_cap, D) region buffers in the model dtype
    with pytest.raises(ValueError, match="v_cache: expected dtype"):
        append(bits=16, v_cache=torch.zeros(Bmax, H, T_cap, D, dtype=torch.int32))
    k_sel = torch.zeros(H, T_cap + G, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="expected at most T_cap"):
        cache_write_prefill(k_sel, k_sel, 0, bufs, 2, G)
    with pytest.raises(ValueError, match="slot: expected an int in"):
        cache_write_prefill(k_sel[:, :5], k_sel[:, :5], Bmax, bufs, 2, G)
    for ring in (R + G, 3, -1):  # over the ring, a part of a group left, negative
        with pytest.raises(ValueError, match=r"ring_tokens: expected an int in \[0, min"):
            cache_write_prefill(k_sel[:, :R + G + 5], k_sel[:, :R + G + 5], 0, bufs, 2, G, ring)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


def _gpu_case(bits, dtype):
    """Real sizes: Bmax = 8 slots (6 active), 8 KV heads, D = 128, R = 128, T_cap = 1024."""
    Bmax, B, H, D, R, G, T_cap = 8, 6, 8, 128, 128, 16, 1024
    bufs = make_cache(Bmax, H, T_cap, R, D, bits, G, dtype, device="cuda")
    bufs[8][:B] = torch.tensor([[0, R], [128, R - 1], [256, 5], [896, R], [1024 - 64, R], [0, 0]],
                               dtype=torch.int32)
    return bufs, B, H, D, G


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 16])
def test_triton_matches_reference_gpu(bits, dtype):
    cuda, B, H, D, G = _gpu_case(bits, dtype)
    _assert_steps_match_reference(   # CUDA: the Triton kernels
        [cuda], B, H, D, dtype, bits, G,
        lambda news: append(*news[0], *cuda, bits, G))


def _assert_steps_match_reference(cuda_layers, B, H, D, dtype, bits, G, step_cuda):
    """Three steps: ``step_cuda`` gets each layer's new (k, v) on the GPU and steps the CUDA
    buffers; the references step a CPU copy of each layer; the buffers must be equal."""
    cpu = [[t.cpu() for t in bufs] for bufs in cuda_layers]
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        news = [new_tokens(B, H, D, dtype, g) for _ in cuda_layers]
        step_cuda([(k.cuda(), v.cuda()) for k, v in news])
        for layer, (bufs, (k_new, v_new)) in enumerate(zip(cpu, news)):
            append(k_new, v_new, *bufs, bits, G, impl="ref")
            assert_buffers_equal([t.cpu() for t in cuda_layers[layer]], bufs,
                                 f"step {step} layer {layer}")


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    # One captured step replayed across per-slot flushes must match eager stepping.
    cuda, B, H, D, G = _gpu_case(2, torch.bfloat16)
    eager = [t.clone() for t in cuda]
    k_in = torch.zeros(B, H, D, dtype=torch.bfloat16, device="cuda")
    v_in = torch.zeros_like(k_in)
    warm = [t.clone() for t in cuda]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                     # warm up (compile the kernels) off-graph
        append(k_in, v_in, *warm, 2, G)
    torch.cuda.current_stream().wait_stream(s)
    layout = CacheLayout([cuda], 2, G)
    live = live_slots(B, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index = cache_begin_step(layout, B, live)
        cache_write_ring(k_in, v_in, cuda[6], cuda[7], index[0])
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        k_new, v_new = new_tokens(B, H, D, torch.bfloat16, g)
        k_in.copy_(k_new)
        v_in.copy_(v_new)
        graph.replay()
        append(k_new.cuda(), v_new.cuda(), *eager, 2, G)
        assert_buffers_equal(cuda, eager, f"replay {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 16])
def test_opcheck_gpu(bits):
    cuda, B, H, D, G = _gpu_case(bits, torch.bfloat16)
    k_new, v_new = (t.cuda() for t in new_tokens(B, H, D, torch.bfloat16,
                                                  torch.Generator().manual_seed(0)))
    k_sel, v_sel = (t.cuda() for t in new_tokens(H, 300, D, torch.bfloat16,
                                                 torch.Generator().manual_seed(1)))
    torch.library.opcheck(torch.ops.minikv.cache_write_prefill.default,
                          (k_sel, v_sel, 7, *cuda, bits, G, 300 % G))


def _gpu_layers(bits, dtype):
    """Real sizes: 4 layers of different capacities, Bmax = 8 slots (6 active), 8 KV heads,
    D = 128, R = 128; full rings with and without room, rings one token short, empty rings,
    the states rotated by one slot per layer."""
    Bmax, B, H, D, R, G = 8, 6, 8, 128, 128, 16
    caps = (1024, 512, 2048, 1024)
    layers = []
    for i, cap in enumerate(caps):
        bufs = make_cache(Bmax, H, cap, R, D, bits, G, dtype, device="cuda", seed=i)
        state = [[0, R], [128, R - 1], [256, 5], [cap - R, R], [cap - 64, R], [0, 0], [0, 0],
                 [0, R]]
        bufs[8].copy_(torch.tensor(state[i:] + state[:i], dtype=torch.int32))
        layers.append(bufs)
    return layers, B, H, D, G


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 16])
def test_triton_begin_step_matches_reference_gpu(bits, dtype):
    cuda, B, H, D, G = _gpu_layers(bits, dtype)
    layout = CacheLayout(cuda, bits, G)
    _assert_steps_match_reference(cuda, B, H, D, dtype, bits, G,
                                  lambda news: step_all_layers(cuda, layout, news, B, bits, G))


@pytest.mark.gpu
def test_begin_step_cuda_graph_replay_gpu():
    # One captured all-layer step replayed across per-slot flushes must match eager stepping.
    cuda, B, H, D, G = _gpu_layers(2, torch.bfloat16)
    eager = [[t.clone() for t in bufs] for bufs in cuda]
    layouts = CacheLayout(cuda, 2, G), CacheLayout(eager, 2, G)
    inputs = [(torch.zeros(B, H, D, dtype=torch.bfloat16, device="cuda"),
               torch.zeros(B, H, D, dtype=torch.bfloat16, device="cuda")) for _ in cuda]
    warm = [[t.clone() for t in bufs] for bufs in cuda]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                     # warm up (compile the kernels) off-graph
        step_all_layers(warm, CacheLayout(warm, 2, G), inputs, B, 2, G)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_all_layers(cuda, layouts[0], inputs, B, 2, G)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        news = [tuple(t.cuda() for t in new_tokens(B, H, D, torch.bfloat16, g)) for _ in cuda]
        for (k_in, v_in), (k_new, v_new) in zip(inputs, news):
            k_in.copy_(k_new)
            v_in.copy_(v_new)
        graph.replay()
        step_all_layers(eager, layouts[1], news, B, 2, G)
        for layer, (got, want) in enumerate(zip(cuda, eager)):
            assert_buffers_equal(got, want, f"replay {step} layer {layer}")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 16])
def test_opcheck_begin_step_gpu(bits):
    cuda, B, H, D, G = _gpu_layers(bits, torch.bfloat16)
    layout = CacheLayout(cuda, bits, G)
    torch.library.opcheck(torch.ops.minikv.cache_begin_step.default,
                          (layout.table, layout.table_host, *layout.columns(),
                           live_slots(B, "cuda", dead=(4,)), B, bits, G))
    k_new, v_new = (t.cuda() for t in new_tokens(B, H, D, torch.bfloat16,
                                                  torch.Generator().manual_seed(0)))
    index = torch.tensor([0, -1, 5, 127, 3, -1], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.minikv.cache_write_ring.default,
                          (k_new, v_new, cuda[0][6], cuda[0][7], index))
