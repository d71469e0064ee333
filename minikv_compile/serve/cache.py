"""--compile-cache: where torch.compile's and Triton's artifacts live across restarts."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

_log = logging.getLogger("minikv_compile.serve")


def use_compile_cache(directory: Optional[str]) -> None:
    """Point inductor's and Triton's on-disk caches at ``directory`` (see ``--compile-cache``)
    before anything compiles; both read these variables when they first need their folder."""
    if directory is None:
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            return
        from minikv_compile.models.smollm2 import default_cache_root
        directory = str(default_cache_root() / "compile")
    root = Path(directory).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache: expected a folder that can be created, got "
                         f"{directory!r} ({e.strerror})") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    _log.info("compile cache: %s", root)
