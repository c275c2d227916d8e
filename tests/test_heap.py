"""The process heap: freed memory handed back, the engine's long-lived objects frozen."""
import gc
import weakref

from pagoda import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_freeze_objects_keeps_the_collector_off_what_lives_until_the_next_call() -> None:
    try:
        dropped = Node()
        ref = weakref.ref(dropped)
        assert heap.freeze_objects() == gc.get_freeze_count() > 0
        del dropped
        gc.collect()
        assert ref() is not None  # frozen: full collections no longer walk it
        heap.freeze_objects()
        assert ref() is None  # unfrozen, collected, the rest frozen again
    finally:
        gc.unfreeze()


def test_trim_answers_a_bool() -> None:
    assert heap.trim() in (True, False)
