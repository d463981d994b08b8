"""run.py's --spindle-env-variant: spindle once per environment at each concurrency (A/B in one run)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.cli_args import env_variant
from benchmarks.run import parse_settings, plan


def test_variants_alternate_at_each_concurrency_with_their_environment() -> None:
    settings = parse_settings(["--models", "medium", "--concurrency", "1,64", "--configs", "spindle",
                               "--scheduler-steps", "8", "--spindle-env-variant",
                               "unfused:SPINDLE_DISABLE_FUSED_KERNELS=1", "--spindle-env-variant", "fused"])
    assert [(j.config, j.concurrency, j.env) for j in plan(settings)] == [
        ("spindle-steps8-unfused", 1, (("SPINDLE_DISABLE_FUSED_KERNELS", "1"),)),
        ("spindle-steps8-fused", 1, ()),
        ("spindle-steps8-unfused", 64, (("SPINDLE_DISABLE_FUSED_KERNELS", "1"),)),
        ("spindle-steps8-fused", 64, ()),
    ]


def test_env_variant_syntax() -> None:
    assert env_variant("x:A=1,B=c=d") == ("x", (("A", "1"), ("B", "c=d")))
    assert env_variant("x:A=-p,-q,B=1") == ("x", (("A", "-p,-q"), ("B", "1"))), "a comma before no NAME= is a value's"
    for bad in ("", ":A=1", "x:A", "x:=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            env_variant(bad)
