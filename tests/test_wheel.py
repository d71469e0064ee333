"""The built wheel ships the library and the report tool (``python -m minikv_compile.perf``), and
nothing of the lab: no ``perf/experiments``, ``perf/results`` or notes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> its package in the wheel (pyproject's package-dir, read independently here).
SOURCES = {"minikv_compile": "minikv_compile", "ops": "minikv_compile/ops",
           "graphs": "minikv_compile/graphs", "models": "minikv_compile/models",
           "perf": "minikv_compile/perf"}
LAB = ("perf/experiments", "perf/results")


def _expected_modules() -> set[str]:
    """Every .py of the library's packages (folders with an ``__init__.py``, reached through
    packages from each source root), at its path in the wheel. Lab folders are no packages."""
    out = set()
    for src, pkg in SOURCES.items():
        for init in (ROOT / src).rglob("__init__.py"):
            folder = init.parent
            parts = folder.relative_to(ROOT / src).parts
            if not all((ROOT / src).joinpath(*parts[:i], "__init__.py").is_file()
                       for i in range(len(parts))):
                continue  # below a folder that is no package
            for path in folder.glob("*.py"):
                rel = path.relative_to(ROOT).as_posix()
                assert not rel.startswith(LAB), f"{rel}: a package inside the lab"
                out.add(pkg + rel[len(src):])
    return out


def test_the_wheel_ships_the_library_and_the_report_tool_not_the_lab(tmp_path):
    # Build from a copy: the build writes build/ and *.egg-info beside the sources, which must
    # not race with other work in the checkout. The lab's folders are copied too, so that the
    # packaging config (not the copy) is what keeps them out.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".cache"))
    assert (src / "perf" / "experiments").is_dir() and (src / "perf" / "NOTES.md").is_file()
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    wheels = list((tmp_path / "dist").glob("minikv_compile-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()

    files = {n for n in names if ".dist-info/" not in n}
    assert not [n for n in files if "experiments" in n or "results" in n.split("/")
                or n.endswith((".md", ".sh", ".json", ".txt", ".log", ".png"))], sorted(files)
    # exactly the library's modules: the public API, ops, graphs, models, the report tool and the
    # accuracy harness, nothing missing and nothing else
    assert files == _expected_modules(), (sorted(files - _expected_modules()),
                                          sorted(_expected_modules() - files))
    for module in ("minikv_compile/__init__.py", "minikv_compile/perf/__main__.py",
                   "minikv_compile/perf/accuracy/__main__.py", "minikv_compile/ops/__init__.py"):
        assert module in files, module

    # the report tool runs from the installed wheel alone (not from the checkout's sources)
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                          str(site), str(wheels[0])], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", "import minikv_compile, runpy, sys; "
                          "print(minikv_compile.__file__); sys.argv = ['perf', '--help']; "
                          "runpy.run_module('minikv_compile.perf', run_name='__main__')"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    where, usage = run.stdout.split("\n", 1)
    assert Path(where).is_relative_to(site), where
    assert usage.startswith("usage: python -m minikv_compile.perf") and "engine-vs-hf" in usage
