"""The worker package asks torch for transparent huge pages under large CPU tensors (services/worker/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "THP_MEM_ALLOC_ENABLE"

# A fresh interpreter: torch first (as a test run or a tool might), then the worker package, then a
# 64 MB tensor; prints the setting it saw and the process's huge-page memory in kB.
PROBE = """
import torch
import services.worker
import os
x = torch.ones(16 * 2**20)
huge = [line.split()[1] for line in open('/proc/self/smaps_rollup') if line.startswith('AnonHugePages')]
print(os.environ.get('THP_MEM_ALLOC_ENABLE'), huge[0] if huge else 'n/a')
"""


def _probe(setting: str | None = None) -> tuple[str, str]:
    """(the setting the probe saw, its huge-page kB), with `setting` given or else unset: this test
    process imported the package too, so its own value must not be inherited."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if setting is not None:
        env[ENV] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, check=True,
                         env=env)
    seen, huge_kb = out.stdout.split()
    return seen, huge_kb


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this kernel gives no transparent huge pages")
def test_large_tensors_get_huge_pages_after_the_worker_package_is_imported() -> None:
    setting, huge_kb = _probe()
    assert setting == "1"
    assert int(huge_kb) >= 32 * 1024  # most of the 64 MB tensor sits in 2 MB pages


def test_an_explicit_setting_is_kept() -> None:
    assert _probe("0")[0] == "0"


# Allocates and fills a 4 MB tensor 50 times after the worker package is imported; prints the
# page faults that took (services/worker/allocator.py: the heap keeps such temporaries).
CHURN = """
import resource
import services.worker
import torch
from services.worker.allocator import keep_large_temporaries_in_the_heap
for _ in range(20):  # huge-page-aligned blocks leave holes the next may not fit until the heap settles
    torch.empty(1 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    torch.empty(1 << 20).fill_(1.0)
print(keep_large_temporaries_in_the_heap(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_step_sized_temporary_reuses_the_heap_instead_of_faulting_in_new_pages() -> None:
    """Without the settings each 4 MB tensor was a fresh mapping: ~500 page faults apiece. Counted
    after 20 tensors: after 3, torch's 2 MB-aligned (huge page) blocks had not settled into the
    heap yet, and in most runs 1-14 of the next 50 still landed on new pages (a flaky count)."""
    out = subprocess.run([sys.executable, "-c", CHURN], cwd=REPO, capture_output=True, text=True, check=True)
    accepted, faults = out.stdout.split()
    assert accepted == "True"
    assert int(faults) < 100, f"{faults} page faults for 50 reused 4 MB tensors"
