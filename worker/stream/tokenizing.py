"""A batch's states tokenized together: one tokenizer job for the states routed together (``worker.stream.routing``),
each state's row read from it through its ``RowSlot``.

One job rather than one per state: a submit to the tokenizer pool (a future, a lock, a thread's wake-up) cost the
loop ~20-60 us a state on this project's CPU machine, and the engine's ``tokenize_many`` makes one call of the Rust
tokenizer for them all (issue 46).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Iterable


class RowSlot:
    """A routed state's tokenized row: its place in the result of the tokenizer job of its batch (``Scorer.tokenize_many``),
    once that job is submitted. ``result()`` as a future's: the row, or the state's tokenization error raised."""

    __slots__ = ("_rows", "_index")

    def __init__(self) -> None:
        self._rows: Future | None = None
        self._index = -1

    def bind(self, rows: Future, index: int) -> None:
        self._rows, self._index = rows, index

    def result(self) -> Any:
        if self._rows is None:
            raise RuntimeError("the state's tokenization was never submitted (Router.flush)")
        row = self._rows.result()[self._index]
        if isinstance(row, BaseException):
            raise row
        return row

    def job(self) -> Future | None:
        """The tokenizer job its row comes from (None until bound)."""
        return self._rows


class TokenizedRows(list):
    """A tokenizer job's rows, and when the job was submitted and done (``time.monotonic()`` seconds): whether the GPU
    thread waited for the tokenizers, or for the GIL after them, is then told apart on the cycle's timeline."""

    __slots__ = ("submitted_at", "done_at")

    def __init__(self, rows: list[Any], submitted_at: float) -> None:
        super().__init__(rows)
        self.submitted_at, self.done_at = submitted_at, time.monotonic()


def bind(slots: "list[RowSlot] | tuple[RowSlot, ...]", rows: Future) -> None:
    """``slots[i]`` holds the i-th row of ``rows`` (a tokenizer job's future)."""
    for index, slot in enumerate(slots):
        slot.bind(rows, index)


def tokenized_rows(schema_engine: Any, handle_future: Future, texts: list[str], submitted_at: float) -> TokenizedRows:
    """(Tokenizer pool) The engine's rows of ``texts`` for the prepared schema of ``handle_future``; where the batch
    call fails, each state alone, so that only the state at fault fails (its error in its place). ``submitted_at``:
    when the job was handed to the pool."""
    handle = handle_future.result()
    try:
        return TokenizedRows(schema_engine.tokenize_many(handle, texts), submitted_at)
    except Exception:  # noqa: BLE001 - which state failed is found below
        rows: list[Any] = []
        for text in texts:
            try:
                rows.append(schema_engine.tokenize(handle, text))
            except Exception as error:  # noqa: BLE001 - it becomes that state's dead letter
                rows.append(error)
        return TokenizedRows(rows, submitted_at)


def last_job_times(rows: Iterable[Any]) -> tuple[float, float] | None:
    """Of the tokenizer jobs that ``rows`` (``RowSlot``s, or other futures of rows, which are skipped) came from, those
    done: when the last was submitted and when the last was done; None where none was."""
    jobs = {id(job): job for row in rows if isinstance(row, RowSlot) and (job := row.job()) is not None}
    done = [job.result() for job in jobs.values() if job.done() and job.exception() is None]
    times = [(result.submitted_at, result.done_at) for result in done if isinstance(result, TokenizedRows)]
    if not times:
        return None
    return max(submitted for submitted, _ in times), max(finished for _, finished in times)
