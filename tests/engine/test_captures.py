"""Captures off the scoring path, on the CPU (`tests/engine/eager_graphs.py`: graphs that replay eagerly): what a
prepared schema announces, that its batches then find every graph captured, that a batch whose graph is missing runs
on a larger one or eagerly without waiting, and what a reallocated bank or a `clear` drops. The CUDA side (times, bits)
is `test_gpu.py`'s."""
import threading
import time

import pytest
import torch

from engine import SchemaEngine
from engine.buckets import batch_buckets, bucket, TS_BUCKETS
from engine.graph_plans import serves
from engine.graphs import GraphManager, StepShape

from .conftest import make_questions, make_states
from .eager_graphs import EagerGraphs, background_engine


def _context_tokens(se, h, texts):
    return sorted({len(se.tokenize(h, t).ids) - se._overhead(h.slots_per_row) for t in texts})


def _approx(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for gq, wq in zip(g, w):
            assert gq == pytest.approx(wq, abs=1e-5)


@pytest.fixture
def plain(eng):
    return SchemaEngine(eng)        # CPU: eager at every batch's own shape


def test_a_schema_announces_every_batch_bucket_at_its_lengths_and_its_batches_then_only_replay(eng, plain):
    se = background_engine(eng)
    questions = make_questions([2, 3, 4])                 # 3 answers a row: graphs of 4
    h = se.prepare(questions)
    texts = make_states(4, seed=3, max_words=12)
    lengths = _context_tokens(se, h, texts)
    plan = se.announce(h, max_batch=4, state_tokens=lengths)
    T = {bucket(n + se._overhead(3), TS_BUCKETS) for n in lengths}
    assert {k for k, _ in plan} == {(4, h.label_mass)}
    assert {(s.R, s.T) for _, s in plan} == {(R, t) for R in batch_buckets(4) for t in T}
    assert plan[0][1] == StepShape(4, max(T), True)       # largest first: it serves every other shape of its key
    assert se.wait_for_captures(60)
    assert se.graph_stats()["graphs"] == len(plan) and se.graph_stats()["pending"] == 0
    assert set(se.graphs.threads) == {"decider-capture"}  # none on the caller's thread
    assert se.graph_plan(h, max_batch=4, state_tokens=lengths) == []      # nothing left to capture

    before = se.graph_stats()
    for n in (1, 3, 4):
        _approx(se.score_lists(h, [se.tokenize(h, t) for t in texts[:n]]),
                plain.score_lists(plain.prepare(questions), [plain.tokenize(h, t) for t in texts[:n]]))
    after = se.graph_stats()
    assert after["replays"] - before["replays"] == 3
    assert (after["eager"], after["covered"], after["captures"]) == (before["eager"], before["covered"],
                                                                    before["captures"])


def test_a_new_schema_runs_on_a_larger_graph_while_its_own_are_captured(eng, plain):
    se = background_engine(eng)
    texts = make_states(3, seed=5, max_words=12)
    wide = se.prepare(make_questions([2] * 9))           # 9 answers a row: graphs of 16
    lengths = _context_tokens(se, wide, texts)
    se.announce(wide, max_batch=4, state_tokens=lengths)
    assert se.wait_for_captures(60)

    se.graphs.gate.clear()                               # the capture thread stalls: the new plan cannot be ready
    questions = make_questions([3, 2])
    narrow = se.prepare(questions)                       # 2 answers a row: graphs of 2, none captured
    plan = se.announce(narrow, max_batch=4, state_tokens=lengths)
    # its own key, and the wide one's at its lengths (a batch mixing both runs as 16 answers a row)
    assert {k for k, _ in plan} == {(2, narrow.label_mass), (16, wide.label_mass)}
    before = se.graph_stats()
    rows = [se.tokenize(narrow, t) for t in texts[:3]]
    started = time.perf_counter()
    got = se.score_lists(narrow, rows)
    waited = time.perf_counter() - started
    mid = se.graph_stats()
    assert mid["covered"] == before["covered"] + 1 and mid["replays"] == before["replays"] + 1
    assert mid["eager"] == before["eager"] and mid["captures"] == before["captures"] and mid["pending"] > 0
    assert waited < 5                                     # the stalled captures did not hold it
    _approx(got, plain.score_lists(plain.prepare(questions), [plain.tokenize(narrow, t) for t in texts[:3]]))

    se.graphs.gate.set()
    assert se.wait_for_captures(60)
    _approx(se.score_lists(narrow, rows), got)
    end = se.graph_stats()
    assert end["covered"] == mid["covered"] and end["replays"] == mid["replays"] + 1   # its own graph now


def test_a_batch_no_graphserves_runs_eagerly_and_its_graph_is_captured_next(eng, plain):
    se = background_engine(eng)
    questions = make_questions([2, 2])
    h = se.prepare(questions)
    rows = [se.tokenize(h, t) for t in make_states(3, seed=7, max_words=10)]
    got = se.score_lists(h, rows)                        # nothing announced, nothing held
    stats = se.graph_stats()
    assert stats["eager"] == 1 and stats["replays"] == 0 and stats["inline"] == 0
    assert se.wait_for_captures(60) and se.graph_stats()["graphs"] == 1
    _approx(se.score_lists(h, rows), got)
    assert se.graph_stats()["replays"] == 1 and se.graph_stats()["eager"] == 1


def test_a_capture_under_way_does_not_hold_the_scoring_thread(eng):
    se = background_engine(eng)
    h = se.prepare(make_questions([2, 2]))
    rows = [se.tokenize(h, t) for t in make_states(2, seed=9, max_words=10)]
    se.score_lists(h, rows)
    assert se.wait_for_captures(60)
    se.graphs.delay_s = 1.5                              # every capture from now on takes 1.5 s
    se.announce(h, max_batch=2, state_tokens=(90,))      # a new length: 2 graphs to capture
    time.sleep(0.1)                                      # the first is under way
    started = time.perf_counter()
    se.score_lists(h, rows)                              # its graph is held: a replay
    assert time.perf_counter() - started < 1.0
    assert se.graph_stats()["pending"] > 0
    se.graphs.delay_s = 0.0
    assert se.wait_for_captures(60)


def test_the_cheapest_held_graph_thatserves_a_step_is_picked():
    g = GraphManager(enabled=True, background=True, serves=serves)
    for full in [(16, True, 8, 64), (16, True, 32, 64), (4, False, 8, 128), (32, True, 8, 72)]:
        g._steps[full] = object()
    assert g.pick((4, False), StepShape(5, 64, True)) == ((16, True), StepShape(8, 64, True))   # 512 tokens
    assert g.pick((2, False), StepShape(8, 100, True)) == ((4, False), StepShape(8, 128, True))
    assert g.pick((32, True), StepShape(4, 72, True)) == ((32, True), StepShape(8, 72, True))
    assert g.pick((16, True), StepShape(8, 100, True)) == ((16, True), StepShape(8, 100, True))  # none: its own
    assert g.pick((16, True), StepShape(8, 64, True)) == ((16, True), StepShape(8, 64, True))    # held: its own
    assert g.stats["covered"] == 3
    inline = GraphManager(enabled=True, serves=serves)
    inline._steps[(16, True, 32, 64)] = object()
    assert inline.pick((4, False), StepShape(5, 64, True)) == ((4, False), StepShape(5, 64, True))


def test_requests_are_queued_once_and_a_waiting_batchs_goes_first():
    g = EagerGraphs(enabled=True, background=True)
    g.gate.clear()
    made = []

    def spec(tag):
        def make():
            made.append(tag)
            return (torch.zeros(2),), (lambda x: x + 1), None, (lambda: True)
        return make

    assert g.request(("k",), StepShape(1, 32, True), spec("blocker"))
    time.sleep(0.05)                                      # the thread holds "blocker", stalled at the gate
    assert g.request(("k",), StepShape(2, 32, True), spec("a"))
    assert g.request(("k",), StepShape(4, 32, True), spec("b"))
    assert not g.request(("k",), StepShape(2, 32, True), spec("a again"))
    assert not g.request(("k",), StepShape(4, 32, True), spec("b again"), first=True)     # moved up, not twice
    assert not g.request(("k",), StepShape(3, 40, False), spec("ungraphed"))
    assert g.pending() == 3
    g.gate.set()
    assert g.wait_idle(10)
    assert made == ["blocker", "b", "a"] and len(g) == 3 and g.stats["captures"] == 3
    assert [r.where for r in g.records] == ["background"] * 3


def test_a_clear_or_a_stale_step_drops_the_capture_under_way_and_the_queue():
    g = EagerGraphs(enabled=True, background=True)

    def make(valid=lambda: True):
        return lambda: ((torch.zeros(2),), (lambda x: x + 1), None, valid)

    g.before_begin = g.clear                             # the bank was reallocated during the warm-up
    g.request(("k",), StepShape(1, 32, True), make())
    assert g.wait_idle(10) and len(g) == 0 and g.stats["captures"] == 0
    g.before_begin = None
    g.request(("k",), StepShape(1, 32, True), make(valid=lambda: False))     # what it reads moved meanwhile
    assert g.wait_idle(10) and len(g) == 0
    g.gate.clear()
    g.request(("k",), StepShape(1, 32, True), make())
    g.request(("k",), StepShape(2, 32, True), make())
    time.sleep(0.05)
    assert g.clear() == []                               # nothing held yet; both requests are dropped
    g.gate.set()
    assert g.wait_idle(10) and len(g) == 0 and g.pending() == 0
    g.request(("k",), StepShape(2, 32, True), make())
    assert g.wait_idle(10) and g.held() == [("k", 2, 32)]


def test_a_reallocated_bank_has_its_graphs_captured_again_in_the_background(eng):
    se = background_engine(eng, prefix_slots=1)
    first = se.prepare(make_questions([2, 3]))
    texts = make_states(3, seed=12, max_words=10)
    se.announce(first, max_batch=4, state_tokens=_context_tokens(se, first, texts))
    assert se.wait_for_captures(60)
    held = set(se.graphs.held())
    assert held
    se.prepare(make_questions([4, 4]), independent=True)          # 2 more slots: new buffers
    se.score_lists(first, [se.tokenize(first, t) for t in texts])  # the step drops the old graphs, asks again
    assert se.wait_for_captures(60)
    assert held <= set(se.graphs.held())


def test_a_mixed_plan_reaches_every_rows_bucket_and_each_schemas_lengths(eng):
    se = background_engine(eng)
    independent = se.prepare(make_questions([2, 2, 3]), independent=True)     # 3 rows a state, 1 answer each
    packed = se.prepare(make_questions([2] * 10))                             # 1 row, 10 answers: graphs of 16
    plan = se.graph_plan(packed, max_batch=8, state_tokens=(40,))
    keys = {k for k, _ in plan}
    assert keys == {(16, packed.label_mass)}                  # alone, and mixed (16 >= 1)
    assert max(s.R for _, s in plan) == 24                    # 8 states x 3 rows, when mixed
    assert {s.T for _, s in plan} == {bucket(40 + se._overhead(10), TS_BUCKETS),
                                      bucket(40 + se._overhead(1), TS_BUCKETS)}
    alone = se.graph_plan(independent, max_batch=8, state_tokens=(40,))
    assert {k for k, _ in alone} == {(1, independent.label_mass), (16, packed.label_mass)}
    se.release(packed)
    assert {k for k, _ in se.graph_plan(independent, max_batch=8, state_tokens=(40,))} == {(1, independent.label_mass)}


def test_without_lengths_or_graphs_nothing_is_planned(eng):
    se = background_engine(eng)
    h = se.prepare(make_questions([2, 2]))
    assert se.graph_plan(h, max_batch=8) == []              # no length given and none scored yet
    se.score_lists(h, [se.tokenize(h, t) for t in make_states(2, seed=1, max_words=8)])
    assert se.wait_for_captures(60)
    assert se.graph_plan(h, max_batch=8)                     # the lengths scored so far
    assert SchemaEngine(eng).graph_plan(h, max_batch=8, state_tokens=(40,)) == []   # CPU: no graphs
    assert SchemaEngine(eng).announce(h, max_batch=8, state_tokens=(40,)) == []


def test_inline_captures_are_counted_as_such(eng):
    se = SchemaEngine(eng)
    se.graphs = EagerGraphs(enabled=True, device=eng.dev)
    h = se.prepare(make_questions([2, 2]))
    se.score_lists(h, [se.tokenize(h, t) for t in make_states(2, seed=1, max_words=8)])
    stats = se.graph_stats()
    assert stats["captures"] == stats["inline"] == 1 and stats["replays"] == 1 and stats["eager"] == 0
    assert threading.current_thread().name in se.graphs.threads
    assert se.warmup(h, batch_sizes=(1, 2), state_tokens=(60,)) >= 0
    assert se.graph_stats()["inline"] == 1 and [r.where for r in se.graphs.records][1:] == ["warmup"] * 2


def test_a_closed_manager_ends_its_thread_and_refuses_requests():
    g = EagerGraphs(enabled=True, background=True)
    make = lambda: ((torch.zeros(2),), (lambda x: x + 1), None, (lambda: True))     # noqa: E731
    assert g.request(("k",), StepShape(1, 32, True), make) and g.wait_idle(10)
    thread = g._thread
    g.close()
    assert g._thread is None and not thread.is_alive()
    assert not g.request(("k",), StepShape(2, 32, True), make) and g.held() == [("k", 1, 32)]
