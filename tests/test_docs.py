"""The user's docs and the lab's indexes point at things that exist: the README's and
docs/results.md's links and anchors, every results folder they cite, every MANIFEST.md row, and
the experiments' index against the scripts in perf/experiments/."""
from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


def test_anchor_matches_github_for_the_headings_used():
    assert _anchor("Decode step against HF's StaticCache (H200)") == \
        "decode-step-against-hfs-staticcache-h200"
    assert _anchor("Longest batch-1 prompt under 24 GiB") == "longest-batch-1-prompt-under-24-gib"


def test_readme_and_results_links_resolve():
    checked = 0
    for doc in (ROOT / "README.md", ROOT / "docs" / "results.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.is_file(), f"{doc.name}: link to missing {target}"
            if anchor:
                assert anchor in _anchors(path), f"{doc.name}: no heading for #{anchor} in {file}"
            checked += 1
    assert checked >= 10  # the README's headline table links every row


def _cited_results(text: str) -> list[list[str]]:
    """Every perf/results path in the text, and the bare names a line lists after a full path:
    each as its candidate paths (beside that path, or inside it when it is a folder)."""
    out = []
    for line in text.splitlines():
        bases = []
        for token in re.findall(r"`([^`]+)`", line):
            if token.startswith("perf/results/"):
                out.append([token])
                parent = token.rstrip("/").rsplit("/", 1)[0] + "/"
                bases = [parent] + ([token] if token.endswith("/") else [])
            elif bases and re.fullmatch(r"[\w.-]+/|[\w.-]+\.(json|txt|md)|_v\w+\.json", token):
                name = "bench_decode_attention" + token if token.startswith("_") else token
                out.append([b + name for b in bases])
    return out


def test_every_cited_results_path_is_in_the_tree():
    results = (ROOT / "docs" / "results.md").read_text()
    folders = [l for l in results.splitlines() if "**Folder**" in l]
    assert len(folders) == results.count("\n## "), "docs/results.md: one Folder line per claim"
    notes = (ROOT / "perf" / "NOTES.md").read_text()
    cited = _cited_results(results) + _cited_results((ROOT / "README.md").read_text()) + \
        _cited_results(notes[notes.index("## Figures the product code quotes"):])
    assert len(cited) >= 40, cited
    missing = [c for c in cited if not any(glob.glob(str(ROOT / p.rstrip("/"))) for p in c)]
    assert missing == [], missing


def test_the_notes_index_cites_only_kept_results():
    """NOTES' index names its evidence as `GPU/entry`, then bare entries of the same folder."""
    notes = (ROOT / "perf" / "NOTES.md").read_text()
    index = notes[notes.index("## Index"):notes.index("\nPer kernel:")]
    cited, missing = 0, []
    for row in index.splitlines()[1:]:
        group = None
        for token in re.findall(r"`([^`]+)`", row):
            head = token.split("/")[0]
            if head in ("h100", "h200", "h100x2", "h200x2", "accuracy"):
                group, path = head, token
            elif group and re.fullmatch(r"[\w.*-]+/|[\w*.-]+\.(json|txt|md)", token):
                path = f"{group}/{token}"
            else:
                continue
            cited += 1
            if not glob.glob(str(RESULTS / path.rstrip("/"))):
                missing.append(path)
    assert cited >= 50 and missing == [], (cited, missing)


def test_every_manifest_row_names_a_file_that_is_kept():
    rows = 0
    for manifest in RESULTS.glob("*/MANIFEST.md"):
        for line in manifest.read_text().splitlines():
            if not line.startswith("| ") or line.startswith(("| file ", "|---")):
                continue
            first = line[2:].split(" | ")[0].split()[0].rstrip(",")
            pattern = re.sub(r"\{[^}]*\}", "*", first).replace(".txt/.json", ".txt")
            assert glob.glob(str(manifest.parent / pattern.rstrip("/"))), \
                f"{manifest.relative_to(ROOT)}: row for {first}, which is not in the tree"
            rows += 1
    assert rows >= 60


def test_the_experiments_index_lists_exactly_the_scripts():
    folder = ROOT / "perf" / "experiments"
    index = (folder / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)`", index, flags=re.M)) | \
        set(re.findall(r"^\| `[\w.]+` \+ `([\w.]+)`", index, flags=re.M))
    scripts = {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")}
    assert listed == scripts, (sorted(listed - scripts), sorted(scripts - listed))
