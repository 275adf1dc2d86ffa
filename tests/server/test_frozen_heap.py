"""``shepherd.frozen_heap``: what is alive is frozen, garbage is not frozen with it; a
command's paused start is frozen when it resumes, and nobody else's heap is."""

from __future__ import annotations

import gc
import weakref

import pytest

from shepherd.cli.main import main
from shepherd.frozen_heap import freeze_startup_objects, pause_collection, resume_collection


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


def test_a_paused_start_is_frozen_when_it_resumes_and_collects_again() -> None:
    assert gc.isenabled()
    try:
        pause_collection()
        assert not gc.isenabled()
        built = Node()  # what a command's start builds: it lives until exit
        resume_collection()
        assert gc.isenabled()
        assert not any(obj is built for obj in gc.get_objects()), "the start was not frozen"
    finally:
        resume_collection()  # a no-op once resumed; else it must not stay pending
        gc.unfreeze()
        gc.enable()


def test_resuming_without_a_pause_changes_nothing() -> None:
    """A caller that turned the collector off itself (or never paused) keeps its state:
    nothing is frozen, nothing turned on."""
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        resume_collection()
        assert not gc.isenabled()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.enable()


def test_the_cli_called_in_process_leaves_the_collector_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Only the process's own command line (``main()``, the ``shepherd`` script) pauses:
    a caller's ``main(argv)`` must not freeze that caller's heap, garbage and all."""
    frozen = gc.get_freeze_count()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert main(["--bmdb-url", "sqlite://", "migrate"]) == 0
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen
