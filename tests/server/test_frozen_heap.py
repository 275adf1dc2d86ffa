"""``freeze_startup_objects``: what is alive is frozen, garbage is not frozen with it."""

from __future__ import annotations

import gc
import weakref

from shepherd.frozen_heap import freeze_startup_objects


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_live_objects_are_frozen_and_cycles_already_dead_are_freed_first() -> None:
    live = Node()
    dead = Node()
    dead.other = Node()
    dead.other.other = dead  # a cycle only the collector frees
    gone = weakref.ref(dead)
    del dead
    try:
        frozen = freeze_startup_objects()
        assert gone() is None, "garbage was frozen with the live objects"
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is live for obj in gc.get_objects()), "a live object was left"
    finally:
        gc.unfreeze()
    assert any(obj is live for obj in gc.get_objects())
