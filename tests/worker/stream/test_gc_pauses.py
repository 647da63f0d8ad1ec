"""The worker's garbage-collector setup: loaded objects frozen out of collections, slow collections reported."""
import gc
import logging

from worker.ops import metrics
from worker.stream import gc_pauses


def _pause_count(generation: str) -> float:
    return next((s.value for s in metrics.GC_PAUSE_SECONDS.collect()[0].samples
                 if s.name.endswith("_count") and s.labels["generation"] == generation), 0.0)


def test_frozen_objects_are_left_out_of_full_collections():
    held = [[i] for i in range(50_000)]               # long-lived containers (the collector tracks these), as a model's
    try:
        frozen = gc_pauses.freeze_loaded_objects()
        # not == frozen: a frozen object freed by its refcount leaves the count, and threads earlier tests left in
        # this process free theirs at any time (a CI run read 482,447 against the 482,449 returned)
        assert len(held) <= gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects(generation=2)}
        assert id(held[0]) not in tracked and id(held[-1]) not in tracked
    finally:
        gc.unfreeze()


def test_every_collection_is_timed_and_a_slow_one_logged(monkeypatch, caplog):
    installed = gc_pauses._on_collection in gc.callbacks   # a worker run in this process installs it too
    gc_pauses.watch_collections()
    gc_pauses.watch_collections()                        # idempotent: one callback
    try:
        assert gc.callbacks.count(gc_pauses._on_collection) == 1
        before = _pause_count("2")
        monkeypatch.setattr(gc_pauses, "SLOW_COLLECTION_S", 0.0)
        with caplog.at_level(logging.WARNING, logger="worker.stream.gc_pauses"):
            gc.collect(2)
        assert _pause_count("2") == before + 1
        assert any("garbage collection of generation 2 took" in r.getMessage() for r in caplog.records)
    finally:
        if not installed:
            gc.callbacks.remove(gc_pauses._on_collection)


def _promoted_to_old(threshold: tuple[int, int, int]) -> bool:
    """Whether a cycle's objects, alive while 15,000 more are allocated, end up in the oldest generation."""
    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(*threshold)
    try:
        cycle = [[i] for i in range(100)]          # a cycle's states: alive for the whole cycle
        others = [[i] for i in range(15_000)]      # what the loop allocates meanwhile (net: they are still held)
        old = {id(o) for o in gc.get_objects(generation=2)}
        del others
        return any(id(o) in old for o in cycle)
    finally:
        gc.set_threshold(*saved)


def test_after_the_freeze_a_cycles_objects_die_young():
    """Python's default young threshold promotes a cycle's objects to the oldest generation within 15,000
    allocations (and full collections then come every few seconds under load); the worker's does not."""
    assert _promoted_to_old((700, 10, 10))
    saved = gc.get_threshold()
    try:
        gc_pauses.freeze_loaded_objects()
        young, middle, old = gc.get_threshold()
        assert young == gc_pauses.YOUNG_THRESHOLD
        assert not _promoted_to_old((young, middle, old))
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def test_the_latest_collections_are_kept_with_when_they_ran_and_a_cycle_event_names_those_it_overlapped():
    import time
    from concurrent.futures import Future

    from worker.formats.records import SourceRecord
    from worker.stream.batcher import Cycle, Pending
    from worker.stream.inflight import InFlight
    from worker.stream.scorer import LaunchTimes

    installed = gc_pauses._on_collection in gc.callbacks
    gc_pauses.watch_collections()
    try:
        cycle = Cycle()
        start = time.monotonic()
        cycle.track(Pending(SourceRecord("states", 0, 0, b"k", b"v")), start)
        gc.collect()
        end = time.monotonic()
        (at, seconds), *_ = gc_pauses.pauses_between(start, end)
        assert start <= at <= end and seconds >= 0
        assert gc_pauses.pauses_between(end + 1.0, end + 2.0) == []
        inflight = InFlight(cycle, [], Future(), closed_at=end, scored_at=end)
        inflight.on_launched(LaunchTimes(end, end, end, captures=2))
        fields = inflight.latency_fields(committed_at=end)
        assert fields["gc_pauses_ms"][0] == [round((at - start) * 1000, 2), round(seconds * 1000, 2)]
        assert fields["graph_captures"] == 2
        later = Cycle()                      # arrived after the collection: none of it in its event
        later.track(Pending(SourceRecord("states", 0, 1, b"k", b"v")), end + 10.0)
        fields = InFlight(later, [], Future(), closed_at=end + 10.0).latency_fields(committed_at=end + 11.0)
        assert "gc_pauses_ms" not in fields and "graph_captures" not in fields
    finally:
        if not installed:
            gc.callbacks.remove(gc_pauses._on_collection)
