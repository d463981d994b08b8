"""The SPINDLE_DISABLE_* switches that turn one speed-up off for side-by-side runs.

One reading for all of them, the one the C++ kernels share (kernels/csrc/env_flag.h): a switch is
on when its variable is set to anything but "" or "0".
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def switch_on(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """True where the environment variable `name` is set to anything but "" or "0"."""
    return environ.get(name, "") not in ("", "0")
