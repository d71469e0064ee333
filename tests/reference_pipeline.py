"""An independent, deliberately plain MiniKV generator: lists of tensors, loops, no custom ops.

Written from docs/algorithm.md alone to check the engine against; it shares no code with the
project (it calls the HF modules directly). Greedy decoding, one sequence, CPU.
"""
from __future__ import annotations

import math

import torch


def _quant_dequant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric uniform quantization of each row of x (groups along the last dim), then back;
    1 bit: the two levels at the midpoints of the lower and upper half of [min, max]."""
    x = x.float()
    mn, mx = x.min(dim=-1, keepdim=True).values, x.max(dim=-1, keepdim=True).values
    if bits == 1:
        scale, zero = ((mx - mn) / 2).half().float(), ((3 * mn + mx) / 4).half().float()
    else:
        scale, zero = ((mx - mn) / (2**bits - 1)).half().float(), mn.half().float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    code = torch.floor((x - zero) / safe + 0.5).clamp(0, 2**bits - 1)
    code = torch.where(scale == 0, torch.zeros_like(code), code)
    return code * scale + zero


def quantize_keys_tokens(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """k (T, D), T % group == 0 -> dequantized keys; a group is one channel over `group` tokens."""
    T, D = k.shape
    g = k.T.reshape(D, T // group, group)
    return _quant_dequant(g, bits).reshape(D, T).T


def quantize_values_tokens(v: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """v (T, D) -> dequantized values; a group is `group` consecutive channels of one token, or
    all D of them where D < group."""
    T, D = v.shape
    group = min(group, D)
    return _quant_dequant(v.reshape(T, D // group, group), bits).reshape(T, D)


def _rot(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class ReferenceMiniKV:
    def __init__(self, model, *, heavy, recent, bits, group, ring, pyramid_depth=None,
                 kept_floor=1):
        self.m, self.cfg = model, model.config
        self.heavy, self.recent, self.bits, self.group, self.R = heavy, recent, bits, group, ring
        self.pyramid_depth, self.kept_floor = pyramid_depth, kept_floor
        c = self.cfg
        self.Hq, self.Hkv = c.num_attention_heads, c.num_key_value_heads
        self.D = getattr(c, "head_dim", None) or c.hidden_size // self.Hq
        self.nl = c.num_hidden_layers

    def _heavy_frac(self, layer):
        if self.pyramid_depth is None:
            return self.heavy
        d = self.pyramid_depth
        lo, hi = self.heavy * (2 - 1 / d), self.heavy / d
        return lo + (hi - lo) * layer / (self.nl - 1)

    def _qkv(self, layer, h, pos):
        blk = self.m.model.layers[layer]
        at = blk.self_attn
        x = blk.input_layernorm(h)
        S = x.shape[0]
        q = at.q_proj(x).view(S, self.Hq, self.D)
        k = at.k_proj(x).view(S, self.Hkv, self.D)
        v = at.v_proj(x).view(S, self.Hkv, self.D)
        if hasattr(at, "q_norm"):
            q, k = at.q_norm(q), at.k_norm(k)
        cos, sin = self.m.model.rotary_emb(h[None], pos[None])
        cos, sin = cos[0][:, None], sin[0][:, None]
        return q * cos + _rot(q) * sin, k * cos + _rot(k) * sin, v  # (S, H, D)

    def _finish(self, layer, h, o):
        blk = self.m.model.layers[layer]
        h = h + blk.self_attn.o_proj(o)
        return h + blk.mlp(blk.post_attention_layernorm(h))

    def _logits(self, h):
        return self.m.lm_head(self.m.model.norm(h)).float()

    @torch.no_grad()
    def generate(self, prompt, n_new):
        L = len(prompt)
        ids = torch.tensor(prompt)
        h = self.m.model.embed_tokens(ids)
        g = self.Hq // self.Hkv
        scale = self.D**-0.5
        self.region = []  # per layer, per kv head: dequantized (T, D) keys and values
        self.ring = []
        for layer in range(self.nl):
            q, k, v = self._qkv(layer, h, torch.arange(L))
            outs, keep = [], []
            for hk in range(self.Hkv):
                col = torch.zeros(L, dtype=torch.float64)
                for hq in range(hk * g, (hk + 1) * g):
                    s = (q[:, hq].double() @ k[:, hk].double().T) * scale
                    s = s.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
                    p = s.softmax(-1)
                    outs.append((hq, (p @ v[:, hk].double()).to(h.dtype)))
                    col += p.sum(0)
                n_rw = min(L, math.ceil(self.recent * L - 1e-9))
                n_hh = max(0, min(round(self._heavy_frac(layer) * L), L - n_rw))
                floor = min(L, self.kept_floor)
                if n_rw + n_hh < floor:  # the floor, shared in the budgets' ratio
                    a = self.recent + self._heavy_frac(layer)
                    n_rw = min(floor, math.ceil((self.recent / a if a else 1.0) * floor - 1e-9))
                    n_hh = floor - n_rw
                if n_rw + n_hh >= L:
                    idx = list(range(L))
                else:
                    top = col[: L - n_rw].topk(n_hh).indices.tolist() if n_hh else []
                    idx = sorted(top + list(range(L - n_rw, L)))
                keep.append(idx)
            o = torch.stack([t for _, t in sorted(outs, key=lambda x: x[0])], dim=1).reshape(L, -1)
            reg, ring = [], []
            for hk in range(self.Hkv):
                ks, vs = k[keep[hk], hk], v[keep[hk], hk]
                # the ring takes all the kept tokens when they fit, else the last ones from half
                # a ring (rounded down to whole groups) up, the region whole groups before them
                kept, half = len(keep[hk]), self.R // (2 * self.group) * self.group
                n = 0 if kept <= self.R else (kept - half) // self.group * self.group
                reg.append(self._quant(ks[:n], vs[:n]))
                ring.append([ks[n:], vs[n:]])
            self.region.append(reg)
            self.ring.append(ring)
            h = self._finish(layer, h, o)
        tok = int(self._logits(h[-1]).argmax())
        out = [tok]
        for step in range(1, n_new):
            pos = L + step - 1
            h = self.m.model.embed_tokens(torch.tensor([tok]))
            for layer in range(self.nl):
                q, k, v = self._qkv(layer, h, torch.tensor([pos]))
                outs = []
                for hk in range(self.Hkv):
                    rk, rv = self.ring[layer][hk]
                    rk, rv = torch.cat([rk, k[:, hk]]), torch.cat([rv, v[:, hk]])
                    qk_, qv_ = self.region[layer][hk]
                    K, V = torch.cat([qk_, rk.float()]), torch.cat([qv_, rv.float()])
                    for hq in range(hk * g, (hk + 1) * g):
                        p = ((q[0, hq].double() @ K.double().T) * scale).softmax(-1)
                        outs.append((hq, (p @ V.double()).to(h.dtype)))
                    if rk.shape[0] == self.R:  # flush after attending
                        nk, nv = self._quant(rk, rv)
                        self.region[layer][hk] = (torch.cat([qk_, nk]), torch.cat([qv_, nv]))
                        rk, rv = rk[:0], rv[:0]
                    self.ring[layer][hk] = [rk, rv]
                o = torch.stack([t for _, t in sorted(outs, key=lambda x: x[0])]).reshape(1, -1)
                h = self._finish(layer, h, o)
            tok = int(self._logits(h[-1]).argmax())
            out.append(tok)
        return out

    def _quant(self, ks, vs):
        if self.bits == 16:
            return ks.float(), vs.float()
        return (quantize_keys_tokens(ks, self.bits, self.group),
                quantize_values_tokens(vs, self.bits, self.group))
