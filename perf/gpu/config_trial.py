"""Device experiment: the decode step with other ``fused_linear`` launch settings for one kind of
projection, without a tree of its own. Runs ``python -m minikv_compile.perf ARGS...`` in this
process with ``ops.linear.launch_config`` wrapped so that the launches the variant names get its
settings (the op reads the config at capture time, so the captured step runs them).

    cd /tmp/run && python /path/to/perf/gpu/config_trial.py gu_128x128x4_plain engine-vs-hf --out DIR ...

Variants: ``base`` (the op's own settings; gate/up at several rows on 64 x 256 tiles, 3 stages,
a PDL launch since 058ca4e); ``gu_128x128x4_plain`` (gate/up as before it: 128 x 128 tiles, 4
stages, one program per SM, a plain launch); ``gu_64x256x3_plain`` (today's tiles, a plain
launch). Alternate them in fresh processes; one inductor cache serves all (the op is opaque to
inductor: its launch settings are not in the compiled graph).
"""
import importlib
import runpy
import sys

lin = importlib.import_module("minikv_compile.ops.linear")

TWO_WAVES = lambda M, N, K: M > 1 and N > 8192  # noqa: E731  (gate/up at several rows)
VARIANTS = {  # name: (applies to (M, N, K)?, settings over the op's own)
    "base": (lambda M, N, K: False, {}),
    "gu_128x128x4_plain": (TWO_WAVES, dict(BLOCK_N=128, BLOCK_K=128, NUM_STAGES=4, pdl=False)),
    "gu_64x256x3_plain": (TWO_WAVES, dict(BLOCK_N=64, BLOCK_K=256, NUM_STAGES=3, pdl=False)),
    # Three stages instead of four on the one-wave launches (96 KB of shared memory: room for a
    # program of the next PDL launch beside each one), and two stages on gate/up (three per SM).
    "gu_64x256x2": (TWO_WAVES, dict(NUM_STAGES=2)),
    "qkv_3_stages": (lambda M, N, K: M > 1 and 4096 < N <= 8192, dict(NUM_STAGES=3)),
    "o_down_3_stages": (lambda M, N, K: M > 1 and N <= 4096, dict(NUM_STAGES=3)),
    "all_3_stages": (lambda M, N, K: M > 1 and N <= 8192, dict(NUM_STAGES=3)),
}

variant = sys.argv.pop(1) if len(sys.argv) > 1 else None
if variant not in VARIANTS:
    sys.exit(f"expected one of {sorted(VARIANTS)} first, got {variant!r}")
applies, settings = VARIANTS[variant]
own = lin.launch_config


def launch_config(M, N, K, dtype, _own=own, _applies=applies, _settings=settings):
    # Everything through default arguments: dynamo traces this (``norm_out_blocks`` calls it in
    # the step) and cannot guard on this script's globals once runpy has replaced ``__main__``.
    cfg = _own(M, N, K, dtype)
    if _applies(M, N, K) and cfg.get("USE_DOT"):
        cfg.update(_settings)
    return cfg


lin.launch_config = launch_config
print(f"variant {variant}: {settings or 'the op defaults'}", flush=True)
sys.argv[0] = "minikv_compile.perf"
runpy.run_module("minikv_compile.perf", run_name="__main__", alter_sys=True)
