"""Enums shared by every service: what a request is, why it ended, why it failed.

Plain Python mirrors of the proto enums in common.proto; `shared/execute_wire.py` and the
services' wire modules convert. Core code uses these, never the generated classes.
"""

from __future__ import annotations

import enum


class RequestKind(enum.IntEnum):
    """What a request asks the engine to do (values match common.proto)."""

    GENERATE = 1
    EMBED = 2
    SCORE = 3


class StopReason(enum.IntEnum):
    """Why a request ended, as the scheduler decided it (values match common.proto)."""

    STOP_TOKEN = 1
    LENGTH = 2
    ABORTED = 3
    POOLED = 4
