"""Command-line value parsers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def comma_list(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """An argparse `type` for "a,b,c": each non-empty item converted by `kind`, as a tuple."""
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def env_variant(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """'unfused:SPINDLE_DISABLE_FUSED_KERNELS=1' -> ('unfused', (('SPINDLE_DISABLE_FUSED_KERNELS', '1'),)).

    A comma starts the next assignment only where a NAME= follows it, so a value may hold commas
    (GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener)."""
    label, _, assignments = text.partition(":")
    env = tuple(tuple(item.split("=", 1)) for item in re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", assignments) if item)
    if not label or any(len(pair) != 2 or not pair[0] for pair in env):
        raise argparse.ArgumentTypeError(f"expected LABEL[:NAME=VALUE,...], got {text!r}")
    return label, env  # type: ignore[return-value]
