"""How does the decode attention's split kernel compile for an H100/H200 (sm_90) per key group
size, without a GPU: the instructions of its hot loop (the quantized region's blocks, "half2"
path) by kind, shared-memory loads, barriers and local-memory spills among them? Issue 47, part
3: at group 64 the kernel took 935 us a step against 720 at group 16 on the Llama-3.1-8B shape at
1 x 32k (H100, 175d4bf), while reading fewer scale bytes.

    python perf/experiments/split_sass.py [--groups 16,64] [--recall] [--maxnreg 96]
    PYTHONPATH=DIR python perf/experiments/split_sass.py   # another Triton, e.g. the GPU
                                                            # machine's 3.6 installed in DIR

Compiles ``_decode_attention_split_kernel`` with the plan's launch for bf16, 2-bit codes, head
dim 128, GQA 4 (``BLOCK_N`` 64 or the group, 4 warps, one stage, prefetch; ``--maxnreg 0`` for
no register cap) and the launch's specializations (aligned pointers), disassembles the cubin with the ``cuobjdump`` of Triton's NVIDIA backend, and counts the
instructions of the loop that holds the dots and the fp16x2 dequantization (a backward branch's
body). Counts are static: the GPU's time is what decides (``perf/gpu/accurate_price.sh``).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minikv_compile.ops import attention_decode as a

KINDS = ("LDS", "STS", "BAR", "LDG", "LDL", "STL", "SHFL", "PRMT", "LOP3", "HFMA2")
_PTRS = ("q_ptr", "k_ptr", "ks_ptr", "kz_ptr", "v_ptr", "vs_ptr", "vz_ptr", "kr_ptr", "vr_ptr",
         "lens_ptr", "m_ptr", "l_ptr", "acc_ptr", "bm_ptr", "rk_ptr", "rv_ptr", "ridx_ptr",
         "lse_ref_ptr", "mass_ptr", "layer_ptr")
_TYPES = dict(q_ptr="*bf16", k_ptr="*i32", ks_ptr="*fp16", kz_ptr="*fp16", v_ptr="*i32",
              vs_ptr="*fp16", vz_ptr="*fp16", kr_ptr="*bf16", vr_ptr="*bf16", lens_ptr="*i32",
              bm_ptr="*i32", rk_ptr="*bf16", rv_ptr="*bf16", ridx_ptr="*i32", layer_ptr="*i32",
              mass_ptr="*u8")
_INTS = ("stride_qb", "stride_qr", "stride_qh", "stride_qd", "stride_lb", "stride_lh", "H_KV",
         "T_CAP", "R", "NUM_SPLITS", "K_REC", "T_MASS", "N_LAYERS", "R_FLUSH")


# What the launch specializes on (Triton's "D": 16-byte aligned pointers, ints that are multiples
# of 16; an int equal to 1 becomes a constant): every pointer (fresh allocations), and these ints
# on the 8B shape (q's strides, the capacity, the recall rows, the layers, the ring's flush).
_DIVISIBLE = _PTRS + ("stride_qb", "stride_qr", "stride_qh", "T_CAP", "K_REC", "N_LAYERS",
                      "R_FLUSH")


def sass_of(group: int, recall: bool, maxnreg: int) -> str:
    consts = dict(GQA=4, BLOCK_H=8, D=128, ROWS=2 if recall else 1, RECALL=recall, BITS=2,
                  G=group, GV=min(group, 128), BLOCK_N=max(64, group), HALF2=True,
                  DOT_DTYPE=tl.float16, INPUT_PRECISION="tf32", BF16_BY_HAND=False,
                  INTERPRET=False, PREFETCH=True, PDL=True, stride_qd=1)
    sig = {p: _TYPES.get(p, "*fp32") for p in _PTRS}
    sig.update({"qk_scale": "fp32", **{n: "i32" for n in _INTS}},
               **{k: "constexpr" for k in consts})
    names = a._decode_attention_split_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE}
    options = dict(num_warps=4, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    kernel = triton.compile(
        ASTSource(fn=a._decode_attention_split_kernel, signature=sig, constexprs=consts,
                  attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def hot_loop(sass: str) -> collections.Counter:
    """Instruction kinds of the loop body (backward branch) with the dots and HFMA2s."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    at = {addr: i for i, (addr, _) in enumerate(ins)}
    for i, (addr, text) in enumerate(ins):
        m = re.match(r"BRA\S*\s+.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in at:
            kinds = collections.Counter(t.split()[0].split(".")[0]
                                        for _, t in ins[at[int(m.group(1), 16)]: i + 1])
            if (kinds["HMMA"] or kinds["HGMMA"]) and kinds["HFMA2"]:
                return kinds
    raise RuntimeError("no loop with dots and HFMA2 found")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="16,64", help="key group sizes")
    p.add_argument("--recall", action="store_true", help="the recall launch (two query rows)")
    p.add_argument("--maxnreg", type=int, default=96, help="register cap (0: none)")
    args = p.parse_args(argv)
    os.environ["PATH"] = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                      "bin") + os.pathsep + os.environ["PATH"]
    print(f"triton {triton.__version__}; split kernel's hot loop, bits 2, bf16, D 128, GQA 4, "
          f"BLOCK_N max(64, group), recall {args.recall}, maxnreg {args.maxnreg or 'none'}")
    print(f"{'group':>5} {'instructions':>12} " + " ".join(f"{k:>6}" for k in KINDS))
    for g in map(int, args.groups.split(",")):
        c = hot_loop(sass_of(g, args.recall, args.maxnreg))
        print(f"{g:>5} {sum(c.values()):>12} " + " ".join(f"{c[k]:>6}" for k in KINDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
