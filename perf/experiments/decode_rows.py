"""Print the decode rows of ``python -m minikv_compile.perf`` reports, one line each, for the
engine A/B script of this folder (``ab_trees.sh``).

    python perf/experiments/decode_rows.py LABEL REPORT.json|RUN_DIR ...
"""
import json
import pathlib
import sys


def main(label: str, *paths: str) -> None:
    for path in map(pathlib.Path, paths):
        for f in sorted(path.glob("*.json")) if path.is_dir() else [path]:
            if not f.exists():  # a run that wrote no report: its log says why
                continue
            d = json.loads(f.read_text())
            bw = d.get("context", {}).get("bandwidth", {}).get("bytes_per_s", 0) / 1e12
            for r in d.get("results", []):
                if r.get("experiment") == "decode" and "ms_per_token" in r:
                    print(f"{label} {r['method']} {r['batch']}x{r['prompt_len']} "
                          f"{r['ms_per_token']:.3f} ms x_floor {r['x_floor']:.3f} "
                          f"copy {bw:.2f} TB/s")


if __name__ == "__main__":
    main(*sys.argv[1:])
