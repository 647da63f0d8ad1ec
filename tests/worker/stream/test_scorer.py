"""The worker's side of the engine, in process with the real tiny model: prepared schemas held within a
byte budget (least recently used and unpinned go first), scores equal to SchemaEngine.score, and a
failing state isolated from the rest of its batch."""

from __future__ import annotations

import time

import pytest

from tests.worker.conftest import QUESTIONS, QUESTIONS_V2, expected_probabilities, state_texts
from tests.worker.faults import failing_on
from worker.formats.records import Reason, question_schema_record
from worker.stream.scorer import BatchJob, Scorer
from worker.stream.tokenizing import RowSlot


def _schema(schema_id: str, document: dict, version: int = 1) -> dict:
    return question_schema_record(document, schema_id, version)


def _score(scorer: Scorer, schema: dict, texts: list[str]):
    handle = scorer.acquire(schema)
    rows = [_row(scorer, handle, t) for t in texts]
    outcome = scorer.submit([BatchJob(handle, rows)]).result(60)[0]
    scorer.release_pin((schema["schema_id"], schema["version"]))
    return outcome


def test_scores_equal_schema_engine_score(schema_engine):
    scorer = Scorer(schema_engine, memory_budget=1 << 30)
    texts = state_texts(6, seed=9)
    try:
        outcome = _score(scorer, _schema("a", QUESTIONS), texts)
    finally:
        scorer.close()
    for got, want in zip(outcome, expected_probabilities(schema_engine, QUESTIONS, texts)):
        assert got.reason is None and not got.truncated
        for g, w in zip(got.probabilities, want):
            assert g == pytest.approx(w, abs=1e-6)


def test_budget_evicts_least_recently_used_unpinned_schemas(schema_engine):
    probe = schema_engine.prepare([{"question": q["question"], "options": q["options"]} for q in QUESTIONS["questions"]])
    one = probe.nbytes
    schema_engine.release(probe)
    scorer = Scorer(schema_engine, memory_budget=int(one * 2.5))  # room for two prepared schemas
    prepared: list[str] = []
    scorer.on_event = lambda kind, info: prepared.append(info["schema_id"]) if kind == "schema_prepared" else None

    def held(schema: dict) -> bool:
        """Whether ``schema`` is held prepared: scoring with it prepares nothing."""
        before = len(prepared)
        _score(scorer, schema, ["probe"])
        return len(prepared) == before

    try:
        a, b, c = (_schema(name, QUESTIONS) for name in "abc")
        pinned = scorer.acquire(a)  # stays pinned: never evicted while a pending state needs it
        pinned.result(60)
        _score(scorer, b, ["x"])
        _score(scorer, c, ["y"])  # over budget: b is the least recently used unpinned one
        assert prepared == ["a", "b", "c"]
        count, held_bytes = scorer.prepared()
        assert count == 2 and held_bytes <= int(one * 2.5)
        assert held(a) and held(c)  # so b was the one evicted
        scorer.release_pin(("a", 1))
        d = _schema("d", QUESTIONS)
        _score(scorer, d, ["z"])  # now a is unpinned and least recently used
        assert prepared == ["a", "b", "c", "d"] and scorer.prepared()[0] == 2
        assert held(c) and held(d)  # so a was the one evicted
        assert _score(scorer, b, ["x"])[0].probabilities and prepared[-1] == "b"  # re-prepared on demand
    finally:
        scorer.close()


def test_unpreparable_schema_and_failing_state_are_isolated(schema_engine):
    scorer = Scorer(failing_on("#boom#")(schema_engine.e), memory_budget=1 << 30)
    try:
        bad = _schema("bad", QUESTIONS_V2)
        bad["questions"][0]["options"] = [f"o{i}" for i in range(27)]
        assert {o.reason for o in _score(scorer, bad, ["a", "b"])} == {Reason.SCHEMA_UNPREPARABLE}

        texts = ["fine one", "this one goes #boom#", "fine two"]
        outcome = _score(scorer, _schema("ok", QUESTIONS), texts)
    finally:
        scorer.close()
    assert [o.reason for o in outcome] == [None, Reason.SCORING_ERROR, None]
    assert "injected" in outcome[1].error
    want = expected_probabilities(schema_engine, QUESTIONS, [texts[0], texts[2]])
    assert outcome[0].probabilities[0] == pytest.approx(want[0][0], abs=1e-6)
    assert outcome[2].probabilities[0] == pytest.approx(want[1][0], abs=1e-6)


def test_a_cycles_schemas_score_as_one_engine_batch(schema_engine):
    """Every schema's states of a cycle go to the engine in one mixed batch, and each gets its own schema's answers."""
    calls: list[int] = []

    class Counting(type(schema_engine)):
        def launch_mixed(self, requests):
            calls.append(len(requests))
            return super().launch_mixed(requests)

    counting = Counting(schema_engine.e)
    scorer = Scorer(counting, memory_budget=1 << 30)
    texts = state_texts(5, seed=13)
    schemas = [_schema("a", QUESTIONS), _schema("b", QUESTIONS_V2)]
    try:
        handles = [scorer.acquire(s) for s in schemas]
        jobs = [BatchJob(h, [_row(scorer, h, t) for t in texts[i::2]]) for i, h in enumerate(handles)]
        outcomes = scorer.submit(jobs).result(60)
    finally:
        scorer.close()
    assert calls == [len(texts)]
    for i, (document, outcome) in enumerate(zip((QUESTIONS, QUESTIONS_V2), outcomes)):
        for got, want in zip(outcome, expected_probabilities(schema_engine, document, texts[i::2])):
            assert got.reason is None
            for g, w in zip(got.probabilities, want):
                assert g == pytest.approx(w, abs=1e-6)


def test_a_schema_met_mid_stream_holds_up_no_batch_for_its_graphs(schema_engine):
    """The worker's first schema waits for its graphs when it is prepared (no other schema's states to hold up); a
    schema met later is prepared without waiting for its own, and batches of it, alone or mixed with the first one's
    states, are scored while those are still to be captured (on a larger captured graph: graphs that replay eagerly,
    `tests/engine/eager_graphs.py`, stand in for CUDA's)."""
    from tests.engine.eager_graphs import background_engine
    from worker.formats.records import engine_questions

    texts = state_texts(4, seed=3)
    probe = schema_engine.prepare(engine_questions(_schema("probe", QUESTIONS)))
    lengths = sorted({len(schema_engine.tokenize(probe, t).ids) - schema_engine._overhead(3) for t in texts})
    schema_engine.release(probe)
    se = background_engine(schema_engine.e)
    scorer = Scorer(se, memory_budget=1 << 30, warmup_state_tokens=lengths, max_batch=4)
    try:
        first = scorer.acquire(_schema("a", QUESTIONS))
        first.result(120)
        assert se.graph_stats()["pending"] == 0 and se.graph_stats()["graphs"] > 0      # captured before it returned
        se.graphs.gate.clear()                                     # from now on no capture finishes
        second = scorer.acquire(_schema("b", QUESTIONS_V2))         # 2 answers a row: graphs not captured yet
        second.result(30)
        assert se.graph_stats()["pending"] > 0
        mixed = [BatchJob(first, [_row(scorer, first, t) for t in texts[:2]]),
                 BatchJob(second, [_row(scorer, second, t) for t in texts[2:]])]
        alone = [BatchJob(second, [_row(scorer, second, t) for t in texts])]
        outcomes = scorer.submit(mixed).result(30) + scorer.submit(alone).result(30)
        stats = se.graph_stats()
        assert stats["pending"] > 0 and stats["eager"] == 0 and stats["covered"] >= 1 and stats["inline"] == 0
    finally:
        se.graphs.gate.set()
        scorer.close()
    want = (expected_probabilities(schema_engine, QUESTIONS, texts[:2])
            + expected_probabilities(schema_engine, QUESTIONS_V2, texts[2:])
            + expected_probabilities(schema_engine, QUESTIONS_V2, texts))
    got = [state for job in outcomes for state in job]
    assert all(state.reason is None for state in got)
    for state, expected in zip(got, want):
        for g, w in zip(state.probabilities, expected):
            assert g == pytest.approx(w, abs=1e-5)


def test_a_launch_says_when_its_states_tokenizer_jobs_were_submitted_and_done(schema_engine):
    """The GPU thread's times of a cycle tell a wait for the tokenizers (the last job done after the cycle was taken)
    from one after them: the last job's submit and finish are reported, in order with the cycle's own times, with the
    GPU thread's own CPU time."""
    from concurrent.futures import Future
    from worker.stream.scored import LaunchTimes

    scorer = Scorer(schema_engine, memory_budget=1 << 30)
    try:
        schema = _schema("a", QUESTIONS)
        handle = scorer.acquire(schema)
        early, late = [RowSlot(), RowSlot()], [RowSlot()]
        before_first = time.monotonic()
        scorer.tokenize_many(handle, state_texts(2, seed=3), early)
        early[0].result()
        between = time.monotonic()
        scorer.tokenize_many(handle, state_texts(1, seed=4), late)
        future_row = Future()  # a row that came from no tokenizer job counts for nothing
        future_row.set_result(early[0].result())
        times: list[LaunchTimes] = []
        outcome = scorer.submit([BatchJob(handle, [*early, future_row, *late])], on_launched=times.append).result(60)
    finally:
        scorer.close()
    assert [state.reason for state in outcome[0]] == [None] * 4
    (launch,) = times
    assert between <= launch.tokenize_submitted_at <= launch.tokenized_at <= launch.gathered_at <= launch.launched_at
    assert before_first <= launch.taken_at
    assert launch.tokenized_at >= late[0].job().result().done_at > early[0].job().result().done_at
    # the GPU thread's own CPU on the way, within the wall time it took (the forward runs before the launch returns
    # on the CPU, so there is some)
    assert 0 < launch.cpu_s <= launch.launched_at - launch.taken_at + 1e-3


def _row(scorer, handle, text):
    """``text``'s tokenized row, as the router makes it: a slot of a tokenizer job (here of one state)."""
    slot = RowSlot()
    scorer.tokenize_many(handle, [text], [slot])
    return slot
