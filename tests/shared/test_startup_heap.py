"""freeze_startup_heap: garbage is collected first, what is alive is frozen, the switch turns it off."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.startup_heap import DISABLE_ENV, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def _collectable(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (frozen objects sit in the permanent one,
    which `gc.get_objects` leaves out)."""
    return any(o is obj for o in gc.get_objects())


def test_garbage_is_collected_and_the_living_heap_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asserted per object, not by comparing freeze counts: a thread another test left running may
    # free frozen objects at any moment, which lowers the count (seen once in a full CI run).
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    alive = _Node()
    assert _collectable(alive)
    frozen = freeze_startup_heap()
    assert dead() is None, "garbage from start-up is freed, not frozen for good"
    assert frozen > 0 and not _collectable(alive)
    gc.collect()
    assert not _collectable(alive), "a full collection leaves the frozen objects where they are"


def test_the_switch_leaves_the_heap_to_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert freeze_startup_heap() == 0
    assert gc.get_freeze_count() == 0
