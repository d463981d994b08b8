"""A SPINDLE_DISABLE_* switch is on when set to anything but "" or "0" (as kernels/csrc/env_flag.h reads it)."""

from __future__ import annotations

import pytest

from shared.switches import switch_on

NAME = "SPINDLE_DISABLE_TEST_SWITCH"


@pytest.mark.parametrize(("value", "on"), [(None, False), ("", False), ("0", False), ("1", True), ("yes", True),
                                           ("00", True)])
def test_a_switch_reads_as_the_kernels_read_it(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert switch_on(NAME) is on
