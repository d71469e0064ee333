"""argparse types of the perf commands: each refuses what it cannot read with the value given."""
from __future__ import annotations

import argparse
import math
from typing import Callable, List, Sequence, Tuple


def _int_at_least(lo: int, expected: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")
nonneg_int = _int_at_least(0, "an integer >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def comma_list(allowed: Sequence[str], what: str, canonical: bool = False
               ) -> Callable[[str], List[str]]:
    """A type for ``"a,b"``: items of ``allowed``, each once, in the order given (``canonical``:
    in ``allowed``'s order, for steps that must run in it)."""
    def parse(text: str) -> List[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what} from {', '.join(allowed)}, got {text!r}")
        return [a for a in allowed if a in items] if canonical else list(dict.fromkeys(items))
    return parse


def shape_list(text: str) -> List[Tuple[int, int]]:
    """``"1x32768,8x4096"`` -> [(1, 32768), (8, 4096)] (batch x prompt length)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.lower().split("x")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"expected BATCHxPROMPT items like 1x32768, got "
                                             f"{item!r}")
        out.append((positive_int(parts[0]), positive_int(parts[1])))
    if not out:
        raise argparse.ArgumentTypeError(f"expected BATCHxPROMPT items like 1x32768, got "
                                         f"{text!r}")
    return out
