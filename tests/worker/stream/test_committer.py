"""The committer against the broker: cycles handed while a transaction runs commit together in the next one (their
records, and per partition the newest offset); a failed transaction ends the taking until the loop resumes it; a
hold lets the transaction running end and gives back the cycles not begun."""

from __future__ import annotations

import contextlib
import threading

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
        assert list(outcome.steps_ms) == ["produce", "offsets", "flush", "commit"] and outcome.outputs
        assert _read_keys(stream) == sorted(f"c{c}-{i}" for c in range(3) for i in range(2))
        assert stream.committed_offsets() == {0: 8, 1: 4}
        assert committer.pending == 0


def test_a_failed_transaction_takes_nothing_until_resumed(stream):
    with _committer(stream, "t-fail") as (committer, woken):
        too_big = OutgoingRecord(stream.topics.probabilities, b"too-big", b"x" * (MAX_MESSAGE_BYTES * 2))
        committer.hand(Handed("bad", _records(stream, 1, "bad") + [too_big], _offsets(stream, (0, 50))))
        [outcome] = _outcomes(committer, woken, 1)
        assert isinstance(outcome.error, AbortableError) and [p.cycle for p in outcome.handed] == ["bad"]
        committer.hand(Handed("after-failure", _records(stream, 1, "dropped"), _offsets(stream, (0, 60))))
        assert committer.pending == 0           # the loop's rewind reads it again: never committed out of order
        committer.resume()
        committer.hand(Handed("redone", _records(stream, 1, "redone"), _offsets(stream, (0, 2))))
        [outcome] = _outcomes(committer, woken, 1)
        assert outcome.error is None
        assert _read_keys(stream) == ["redone-0"] and stream.committed_offsets()[0] == 2


def test_a_hold_lets_the_running_transaction_end_and_gives_back_the_rest(stream):
    with _committer(stream, "t-hold") as (committer, woken):
        committer.hand(Handed("first", _records(stream, 50, "first"), _offsets(stream, (0, 10))))
        committer.hand(Handed("second", _records(stream, 1, "second"), _offsets(stream, (0, 11))))
        back = [part.cycle for part in committer.hold()]
        committed = [part.cycle for outcome in committer.outcomes() for part in outcome.handed]
        # what had begun has ended (committed); what had not comes back, in order; nothing runs while held
        assert committed + back == ["first", "second"] and committer.pending == 0
        newest = {0: -1001, 1: 10, 2: 11}[len(committed)]
        assert stream.committed_offsets()[0] == newest
        committer.hand(Handed("third", _records(stream, 1, "third"), _offsets(stream, (0, 12))))
        assert woken.acquire(timeout=0.5) is (len(committed) > 0)   # the wake-up of the transaction that ended
        assert committer.pending == 1 and stream.committed_offsets()[0] == newest
        committer.release()
        _outcomes(committer, woken, 1)
        assert stream.committed_offsets()[0] == 12
