"""Device experiment: an A/B of ``fused_linear``'s row spreading inside the whole engine. Runs
``python -m minikv_compile.perf ARGS...`` in this process, with the spreading on (``on``: the
shipped launch rule) or off (``off``: every program a full tile of rows, the rule before it).

    cd /tmp/run && python /path/to/perf/gpu/ab_linear_rows.py off engine-vs-hf --out DIR ...

Alternate ``on`` and ``off`` runs in one device call to compare them.
"""
import importlib
import runpy
import sys

lin = importlib.import_module("minikv_compile.ops.linear")

mode = sys.argv.pop(1)
if mode not in ("on", "off"):
    sys.exit(f"expected 'on' or 'off' first, got {mode!r}")
if mode == "off":
    shipped = lin.launch_config
    lin.launch_config = lambda M, N, K, dtype, sms=None: shipped(M, N, K, dtype)
print(f"row spreading {mode}", flush=True)
sys.argv[0] = "minikv_compile.perf"
runpy.run_module("minikv_compile.perf", run_name="__main__", alter_sys=True)
