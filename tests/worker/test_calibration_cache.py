"""The calibration's keys: a run with a kernel switch on does not read timings measured with it off."""

from __future__ import annotations

import pytest

from services.worker.models.calibration_cache import KERNEL_SWITCHES, entry_key


@pytest.mark.parametrize("switch", KERNEL_SWITCHES)
def test_a_kernel_switch_that_is_on_gets_keys_of_its_own(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plain = entry_key(8192, 256, "bfloat16", False, 2, onednn=True, activation_dtype="bfloat16")
    monkeypatch.setenv(switch, "0")
    assert entry_key(8192, 256, "bfloat16", False, 2, onednn=True, activation_dtype="bfloat16") == plain
    monkeypatch.setenv(switch, "1")
    keyed = entry_key(8192, 256, "bfloat16", False, 2, onednn=True, activation_dtype="bfloat16")
    assert keyed != plain and keyed.startswith(plain) and switch in keyed
