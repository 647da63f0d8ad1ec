"""The committer against the broker: cycles handed while a transaction runs commit together in the next one (their
records, and per partition the newest offset); a failed transaction ends the taking until the loop resumes it; a
hold lets the transaction running end and gives back the cycles not begun."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest
from confluent_kafka import TopicPartition

from tests.worker.stream.test_transactions import MAX_MESSAGE_BYTES, _read_keys, _records, _transactions
from worker.exceptions import AbortableError
from worker.formats.records import OutgoingRecord
from worker.stream.committer import Committer, Handed, merged_offsets


@contextlib.contextmanager
def _committer(stream, txn_id: str):
    woken = threading.Semaphore(0)
    with _transactions(stream, txn_id) as txns:
        committer = Committer(txns, woken.release)
        try:
            yield committer, woken
        finally:
            committer.close()


def _offsets(stream, *pairs: tuple[int, int]) -> list[TopicPartition]:
    return [TopicPartition(stream.topics.states, p, o) for p, o in pairs]


class _Gated:
    """``txns`` whose transactions, once begun on the committer's thread, wait there until the test lets them end
    (``let_end``; ``open`` lets every one go on from then on): ``begun`` is released as each begins."""

    def __init__(self, txns) -> None:
        self._txns = txns
        self.begun = threading.Semaphore(0)
        self._go = threading.Semaphore(0)
        self._open = threading.Event()

    def commit(self, records, offsets, group_metadata=None) -> None:
        self.begun.release()
        if not self._open.is_set():
            assert self._go.acquire(timeout=60), "the test never let the transaction end"
        self._txns.commit(records, offsets, group_metadata)

    def let_end(self) -> None:
        self._go.release()

    def open(self) -> None:
        self._open.set()
        self._go.release()

    def __getattr__(self, name):        # last_steps_ms, last_outputs: the real transactions'
        return getattr(self._txns, name)


@contextlib.contextmanager
def _gated_committer(stream, txn_id: str):
    woken = threading.Semaphore(0)
    with _transactions(stream, txn_id) as txns:
        gate = _Gated(txns)
        committer = Committer(gate, woken.release)
        try:
            yield committer, woken, gate
        finally:
            gate.open()
            committer.close()


def _outcomes(committer: Committer, woken: threading.Semaphore, count: int) -> list:
    ended = []
    while len(ended) < count:
        assert woken.acquire(timeout=20), "the committer reported no outcome"
        ended += committer.outcomes()
    return ended


def test_merged_offsets_keep_the_newest_per_partition(stream):
    first = Handed("a", [], _offsets(stream, (0, 5), (1, 7)))
    second = Handed("b", [], _offsets(stream, (0, 9)))
    assert {(tp.partition, tp.offset) for tp in merged_offsets([first, second])} == {(0, 9), (1, 7)}


def test_cycles_handed_meanwhile_commit_as_one_transaction(stream):
    with _committer(stream, "t-group") as (committer, woken):
        assert committer.hold() == []           # nothing begins while held: the three cycles wait together
        for i, offsets in enumerate([((0, 3),), ((1, 4),), ((0, 8),)]):
            committer.hand(Handed(f"cycle-{i}", _records(stream, 2, f"c{i}"), _offsets(stream, *offsets)))
        assert committer.pending == 3
        committer.release()
        [outcome] = _outcomes(committer, woken, 1)
        assert outcome.error is None and [part.cycle for part in outcome.handed] == ["cycle-0", "cycle-1", "cycle-2"]
        assert outcome.committed_at is not None and outcome.commit_ms > 0
        assert list(outcome.steps_ms) == ["begin", "produce", "offsets", "flush", "commit"] and outcome.outputs
        assert _read_keys(stream) == sorted(f"c{c}-{i}" for c in range(3) for i in range(2))
        assert stream.committed_offsets() == {0: 8, 1: 4}
        assert committer.pending == 0


def test_a_failed_transaction_takes_nothing_until_resumed(stream):
    """A cycle handed while the transaction that fails is still running is uncommitted work the loop's rewind reads
    again, like one handed after the failure: neither ever commits, before or after ``resume``."""
    with _gated_committer(stream, "t-fail") as (committer, woken, gate):
        too_big = OutgoingRecord(stream.topics.probabilities, b"too-big", b"x" * (MAX_MESSAGE_BYTES * 2))
        committer.hand(Handed("bad", _records(stream, 1, "bad") + [too_big], _offsets(stream, (0, 50))))
        assert gate.begun.acquire(timeout=20), "the failing transaction never began"
        committer.hand(Handed("meanwhile", _records(stream, 1, "meanwhile"), _offsets(stream, (0, 55))))
        gate.let_end()
        [outcome] = _outcomes(committer, woken, 1)
        assert isinstance(outcome.error, AbortableError) and [p.cycle for p in outcome.handed] == ["bad"]
        committer.hand(Handed("after-failure", _records(stream, 1, "dropped"), _offsets(stream, (0, 60))))
        gate.open()
        committer.resume()
        committer.hand(Handed("redone", _records(stream, 1, "redone"), _offsets(stream, (0, 2))))
        ended = []
        while not any(part.cycle == "redone" for outcome in ended for part in outcome.handed):
            ended += _outcomes(committer, woken, 1)
        # what a read_committed reader sees: the redone cycle alone, never one handed before the rewind
        assert [[part.cycle for part in outcome.handed] for outcome in ended] == [["redone"]]
        assert _read_keys(stream) == ["redone-0"] and stream.committed_offsets()[0] == 2


def _blocked_inside(thread: threading.Thread, method) -> bool:
    """Whether ``thread`` waits on a condition (``threading``'s ``wait``) inside a call of ``method``."""
    frame, codes = sys._current_frames().get(thread.ident), []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    return bool(codes) and codes[0].co_name == "wait" and method.__code__ in codes


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_hold_lets_the_running_transaction_end_and_gives_back_the_rest(stream):
    """``hold`` during a transaction: it returns once that transaction has ended (committed: its records visible,
    its offset committed, its outcome there to take), with the cycles not begun, in order; nothing begins while
    held."""
    with _gated_committer(stream, "t-hold") as (committer, woken, gate):
        committer.hand(Handed("first", _records(stream, 3, "first"), _offsets(stream, (0, 10))))
        assert gate.begun.acquire(timeout=20), "the first transaction never began"
        committer.hand(Handed("second", _records(stream, 1, "second"), _offsets(stream, (0, 11))))
        committer.hand(Handed("third", _records(stream, 1, "third"), _offsets(stream, (0, 12))))
        held: dict = {}

        def hold_and_look() -> None:
            back = committer.hold()
            # taken at once: what had ended when hold() returned
            held.update(back=[p.cycle for p in back], ended=committer.outcomes(), keys=_read_keys(stream),
                        offset=stream.committed_offsets()[0])

        holder = threading.Thread(target=hold_and_look)
        holder.start()
        # the first transaction ends only once hold() waits for it (or has returned without waiting)
        _until(lambda: _blocked_inside(holder, Committer.hold) or not holder.is_alive())
        gate.let_end()
        holder.join(30)
        assert not holder.is_alive(), "hold() never returned"
        assert [[p.cycle for p in o.handed] for o in held["ended"]] == [["first"]] and held["ended"][0].error is None
        assert held["keys"] == ["first-0", "first-1", "first-2"] and held["offset"] == 10
        assert held["back"] == ["second", "third"] and committer.pending == 0
        assert woken.acquire(timeout=20)                                # the wake-up of the transaction that ended
        committer.hand(Handed("fourth", _records(stream, 1, "fourth"), _offsets(stream, (0, 13))))
        assert not gate.begun.acquire(timeout=0.5) and committer.pending == 1   # held: nothing begins
        committer.release()
        assert gate.begun.acquire(timeout=20)
        gate.let_end()
        [outcome] = _outcomes(committer, woken, 1)
        assert outcome.error is None and [p.cycle for p in outcome.handed] == ["fourth"]
        assert stream.committed_offsets()[0] == 13 and _read_keys(stream) == ["first-0", "first-1", "first-2", "fourth-0"]


@pytest.mark.parametrize("linger_s", [0.0, 1.0])
def test_a_lingering_committer_lets_later_cycles_join_the_oldest_ones_transaction(stream, linger_s):
    """With a linger, a cycle handed while no transaction runs waits that long for the next ones, which commit with
    it; without one it begins at once, alone (the second, handed 0.2 s later, commits in a transaction of its own)."""
    woken = threading.Semaphore(0)
    with _transactions(stream, f"t-linger-{linger_s:g}") as txns:
        committer = Committer(txns, woken.release, linger_s=linger_s)
        try:
            first = Handed("first", _records(stream, 1, "a"), _offsets(stream, (0, 1)))
            committer.hand(first)
            time.sleep(0.2)
            committer.hand(Handed("second", _records(stream, 1, "b"), _offsets(stream, (1, 1))))
            ended = _outcomes(committer, woken, 1)
            if linger_s:
                [outcome] = ended
                assert [part.cycle for part in outcome.handed] == ["first", "second"]
                assert outcome.committed_at - first.handed_at >= linger_s
            else:
                ended += _outcomes(committer, woken, 2 - len(ended))
                assert [[part.cycle for part in outcome.handed] for outcome in ended] == [["first"], ["second"]]
            assert _read_keys(stream) == ["a-0", "b-0"]
        finally:
            committer.close()
