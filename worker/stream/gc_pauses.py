"""Keeping Python's garbage collector out of the latency: freeze what was loaded, report the pauses that remain.

A worker holds torch, transformers and a model: some 350k objects that live as long as the process. Every full
(generation 2) collection walks all of them, 160-205 ms on this 2-core machine, and stops every thread meanwhile:
the open cycle's states wait; the timing below tells whether a stall of the stream was a collection. ``gc.freeze()`` moves the objects alive at
that moment to a generation the collector never walks, so later collections see only what the loop itself keeps;
the collector still runs, and reference cycles made later are still freed.

Freezing has a side effect the young-generation threshold corrects. Python collects generation 2 when the objects
promoted into it since the last full collection exceed a quarter of those already there, and after a freeze "those
already there" are few: at Python's default threshold (a young collection every 700 net allocations, a middle one
every tenth) a state's objects, alive for the tens of milliseconds of its cycle, outlived two young collections and
were promoted, and on the H200 at half load a full collection ran every 2 s, 7-67 ms each, inside whatever broker call
the loop was in (run BX in bench/README.md: the p99 of budgets 50 and 100 went from 33-41 ms at 40% load to 86-99 ms
at 50%). A young collection every YOUNG_THRESHOLD allocations lets a cycle's objects die young.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque

from worker.ops import metrics

log = logging.getLogger(__name__)

SLOW_COLLECTION_S = 0.05
"""A collection at least this long is logged as a warning: it delays every state in the open cycle."""

YOUNG_THRESHOLD = 20_000
"""Net allocations between two young-generation collections once the loaded objects are frozen (Python's default:
700). A young collection then walks at most this many objects, a few milliseconds."""

RECENT = 256
"""Collections remembered with when they ran (``pauses_between``): a cycle's are in the ``committed`` event."""

_started: list[float] = []
_recent: deque[tuple[float, float]] = deque(maxlen=RECENT)   # (monotonic start, seconds) of the latest collections


def freeze_loaded_objects() -> int:
    """Exempt every object alive now from future collections (call once, when the model is loaded: a frozen object
    that later becomes part of a garbage cycle is never freed, so nothing that can be released, such as a prepared
    schema and its graphs, should be frozen). Returns how many objects are frozen in all."""
    gc.collect()                 # what is garbage already should be freed, not frozen
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    return gc.get_freeze_count()


def watch_collections() -> None:
    """Time every collection into ``decider_gc_pause_seconds``; log a warning for one of SLOW_COLLECTION_S or more."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.monotonic())
        return
    if not _started:
        return
    started = _started.pop()
    seconds = time.monotonic() - started
    _recent.append((started, seconds))
    metrics.GC_PAUSE_SECONDS.labels(str(info.get("generation", "?"))).observe(seconds)
    if seconds >= SLOW_COLLECTION_S:
        log.warning("garbage collection of generation %s took %.0f ms (%d objects frozen, %d collected)",
                    info.get("generation"), seconds * 1000, gc.get_freeze_count(), info.get("collected", 0))


def pauses_between(start: float, end: float) -> list[tuple[float, float]]:
    """The collections (monotonic start, seconds) that overlapped [start, end] (monotonic seconds), of the latest
    RECENT: what stopped every thread while a cycle was on its way (``bench/tail_causes.py`` charges them to it)."""
    return [(at, seconds) for at, seconds in list(_recent) if at <= end and at + seconds >= start]
