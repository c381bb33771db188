"""track_1_short/frozen_gc.py: the collector's state while frozen and after (invariants 1 and 2).

The trainer-level checks (the loop runs frozen, an error restores, bitwise-equal results) are in
tests/test_train.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from track_1_short.frozen_gc import freeze_gc, restore_gc


@pytest.fixture(autouse=True)
def gc_as_found():
    """Whatever a test does, the session's collector is left as it was."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if not frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_frozen_between_freeze_and_restore_then_back_as_found(enabled):
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()
    state = freeze_gc()
    assert not gc.isenabled()
    assert gc.get_freeze_count() > 0  # the objects alive now (this test's frames at least) were frozen
    restore_gc(state)
    assert gc.isenabled() == enabled
    assert gc.get_freeze_count() == 0


def test_freeze_collects_the_garbage_made_before_it():
    gc.unfreeze()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    alive = weakref.ref(a)
    del a, b
    state = freeze_gc()
    try:
        assert alive() is None  # collected before the freeze, not kept for good in the permanent generation
    finally:
        restore_gc(state)


def test_an_earlier_freeze_is_left_in_place():
    gc.unfreeze()
    gc.freeze()
    before = gc.get_freeze_count()
    state = freeze_gc()
    restore_gc(state)
    assert gc.get_freeze_count() >= before  # not ours to undo
    assert gc.isenabled()


def test_restore_of_none_changes_nothing():
    gc.enable()
    restore_gc(None)
    assert gc.isenabled()
