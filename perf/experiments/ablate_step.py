"""Device experiment: what a small kernel of the decode step costs on its critical path, as an
upper bound for fusing it away. Runs ``python -m minikv_compile.perf ARGS...`` in this process
with the launches of one kind skipped (their outputs are then garbage: timing only).

    python perf/experiments/ablate_step.py no_norm engine-vs-hf --out DIR ...   # after perf/gpu_check.sh

Ablations: ``none``; ``no_norm`` (the ``rms_norm`` launches: since 4dc6959 only the one before
the first layer's q/k/v at several rows, the other norms being split over the projections);
``no_flush`` (the all-layer flush launch of ``cache_begin_step``); ``no_append`` (that, the
counter launch and every layer's ``cache_write_ring``);
``no_combine`` (the decode-attention combine launch).
"""
import importlib
import runpy
import sys


class _Skipped:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _skip(module: str, *kernels: str) -> None:
    mod = importlib.import_module(module)
    for name in kernels:
        getattr(mod, name)  # fail loudly on a renamed kernel
        setattr(mod, name, _Skipped())


ABLATIONS = {
    "none": [],
    "no_norm": [("minikv_compile.ops.linear", "_rms_norm_kernel")],
    "no_flush": [("minikv_compile.ops.cache_update", "_flush_layers_kernel")],
    "no_append": [("minikv_compile.ops.cache_update", "_flush_layers_kernel", "_commit_kernel",
                   "_write_ring_kernel")],
    "no_combine": [("minikv_compile.ops.attention_decode", "_decode_attention_combine_kernel")],
}

ablation = sys.argv.pop(1)
if ablation not in ABLATIONS:
    sys.exit(f"expected one of {sorted(ABLATIONS)} first, got {ablation!r}")
for module, *kernels in ABLATIONS[ablation]:
    _skip(module, *kernels)
print(f"ablation {ablation}", flush=True)
sys.argv[0] = "minikv_compile.perf"
runpy.run_module("minikv_compile.perf", run_name="__main__", alter_sys=True)
