"""Command-line value parsers shared by the benchmark scripts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def comma_list(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """An argparse `type` for "a,b,c": each non-empty item converted by `kind`, as a tuple."""
    return lambda text: tuple(kind(x) for x in text.split(",") if x)
