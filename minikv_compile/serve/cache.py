"""--compile-cache: where torch.compile's and Triton's artifacts live across restarts.

They are loaded as code: like SSH with its keys, the server refuses a cache folder that another
user can write (the folder, one of its subfolders, or a folder above it without the sticky bit)
or that another user owns, and warns about one its group can write."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Optional

_log = logging.getLogger("minikv_compile.serve")


def use_compile_cache(directory: Optional[str]) -> None:
    """Point inductor's and Triton's on-disk caches at ``directory`` (see ``--compile-cache``)
    before anything compiles; both read these variables when they first need their folder.
    Raises ``ValueError`` for a folder other users can write (``check_private``)."""
    if directory is None:
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
            if inductor.exists():
                check_private(inductor, "$TORCHINDUCTOR_CACHE_DIR")
            return
        from minikv_compile.models.smollm2 import default_cache_root
        directory = str(default_cache_root() / "compile")
    root = Path(directory).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache: expected a folder that can be created, got "
                         f"{directory!r} ({e.strerror})") from None
    check_private(root, "--compile-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    _log.info("compile cache: %s", root)


def check_private(root: Path, flag: str) -> None:
    """Refuse ``root`` if a user other than this one (or root) owns it or can write it, one of
    its subfolders, or a folder above it (a world-writable one with the sticky bit, /tmp, is
    fine: no one can rename what is not theirs there); warn if its group can write it."""
    me = os.geteuid()
    root = root.resolve()
    below = [p for p in root.iterdir() if p.is_dir()]
    for path in [root, *below, *root.parents]:
        st = path.stat()
        mode = st.st_mode
        above = path in root.parents
        if st.st_uid not in (me, 0):
            raise ValueError(f"{flag}: expected a folder of this user (uid {me}) whose compiled "
                             f"code no one else can replace, got {path} owned by uid {st.st_uid}")
        if mode & stat.S_IWOTH and not (above and mode & stat.S_ISVTX):
            raise ValueError(f"{flag}: expected a folder no other user can write (its compiled "
                             f"code is loaded and run), got {path} with mode "
                             f"{stat.filemode(mode)}; chmod o-w it")
        if mode & stat.S_IWGRP and not above:
            _log.warning("%s: %s is writable by its group (mode %s): every member can replace "
                         "the compiled code this server runs; chmod g-w it if that is not meant",
                         flag, path, stat.filemode(mode))
