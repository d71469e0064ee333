"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs kernels as Python and misses what only the compiler rejects (a
non-constexpr global, a type or shape error in a branch): ``compile_for_sm90(body)`` runs
``body`` in a fresh process without ``TRITON_INTERPRET``, with ``build(kernel, signature,
constexprs)`` defined, and fails the calling test with the compiler's message.
"""
import os
import subprocess
import sys

_PRELUDE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(kernel, sig, consts):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32))
"""


def compile_for_sm90(body: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = _PRELUDE + body + "\nprint('compiled')\n"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
