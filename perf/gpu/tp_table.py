"""The table perf/gpu/tp4.sh prints last: every bench_tp row of DIR against its floor, HF's row
of the same case and ranks, and the same case over two ranks; then tp_account's account.

    python perf/gpu/tp_table.py DIR     (DIR: tp4.json, tp4_hf.json, tp4_131k.json, tp2.json,
                                         tp4_account*.json, each where its part ran)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str) -> int:
    d = Path(folder)
    rows = []
    for name in ("tp4", "tp4_131k", "tp2", "tp4_hf"):
        path = d / f"{name}.json"
        if path.exists():
            rows += json.loads(path.read_text())["rows"]
    ours = [r for r in rows if not r["method"].startswith("hf")]
    hf = {(r["batch"], r["prompt_len"], r["ranks"]): r for r in rows if r["method"].startswith("hf")}
    two = {(r["batch"], r["prompt_len"]): r for r in ours if r["ranks"] == 2}
    print("| case | ranks | ms/token | floor ms (collectives) | x floor | HF tp_plan ms | x HF | "
          "x 2 ranks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in ours:
        case = (r["batch"], r["prompt_len"])
        theirs = hf.get(case + (r["ranks"],))
        pair = two.get(case) if r["ranks"] != 2 else None
        print(f"| {r['batch']} x {r['prompt_len']} | {r['ranks']} | {r['ms_per_token']:.2f} | "
              f"{r.get('floor_ms', float('nan')):.2f} ({r['step_collectives_ms']:.2f}) | "
              f"{r.get('x_floor', float('nan')):.2f} | "
              + (f"{theirs['ms_per_token']:.2f} | {r['ms_per_token'] / theirs['ms_per_token']:.3f}"
                 if theirs else "- | -")
              + (f" | {r['ms_per_token'] / pair['ms_per_token']:.3f} |" if pair else " | - |"))
    for r in hf.values():
        if not any((o["batch"], o["prompt_len"], o["ranks"]) == (r["batch"], r["prompt_len"],
                                                                  r["ranks"]) for o in ours):
            print(f"| {r['batch']} x {r['prompt_len']} | {r['ranks']} | HF alone "
                  f"{r['ms_per_token']:.2f} | | | | | |")
    for account in sorted(d.glob("tp4_account*.md")):  # the default, then each variant
        print()
        print(account.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
