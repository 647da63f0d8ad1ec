"""The worker's side of the engine: one GPU thread, a tokenizer pool, and prepared schemas within a budget.

The device is used from one thread only (``decider-gpu``, a single-thread executor, which is the GPU lock):
schema preparation and the launch of each batch are queued there. A launched batch's scores are read by a second
thread (``decider-collect``), so the next batch is queued on the device before the one ahead of it finishes. Tokenizing
runs on a small pool, beside the batch on the GPU. Nothing here reaches inside tensors: ``PendingScores`` gives floats.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from worker.ops import metrics
from worker.config import WorkerConfig
from worker.exceptions import ConfigError
from worker.formats.records import Reason, SchemaKey, engine_options, engine_questions, probabilities_problem
from worker.stream.scored import LaunchTimes, ScoredState
from worker.stream.tokenizing import RowSlot, bind, last_job_times, tokenized_rows

log = logging.getLogger(__name__)

# A schema the engine rejected is not retried for every state; after this long it is tried again, in
# case the failure was transient (device memory exhausted by other schemas at the time).
FAILED_PREPARE_RETRY_S = 60.0


def load_scorer(config: WorkerConfig) -> tuple[Any, Scorer]:
    """Load the model on the device thread and wrap it: (the engine, its ``Scorer``); ``ConfigError`` with the
    engine's message on a bad model directory."""
    if config.device == "cpu":
        # OpenMP's default active wait makes torch's idle pool threads spin between ops; next to the Kafka
        # clients and tokenizer threads that starved CPU scoring (~15 vs ~150 states/s on 2 cores). It only
        # takes effect if set before torch starts OpenMP, i.e. before the import below in a fresh process.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from engine import DeviceUnavailableError, Engine, KernelsUnavailableError, SchemaEngine  # torch: only where scored

    gpu = device_thread()
    try:
        engine = gpu.submit(Engine.load, config.model_dir, device=config.device, dtype=config.resolved_dtype,
                            deterministic=config.deterministic).result()
    except DeviceUnavailableError as exc:
        raise ConfigError.device_unavailable(config.device, exc.reason) from exc
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot load the model from {config.model_dir}: {exc}") from exc
    except RuntimeError as exc:  # e.g. CUDA requested on a machine without it
        raise ConfigError(f"cannot load the model on {config.device}: {exc}") from exc
    except Exception as exc:  # a damaged checkpoint can fail anywhere in the loaders: still the user's input
        raise ConfigError(f"cannot load the model from {config.model_dir}: {type(exc).__name__}: {exc}") from exc
    try:
        # builds the forward, and with it the kernel table; a batch never waits for a CUDA graph's capture: a thread
        # of the engine's captures them beside the scoring (``SchemaEngine.announce``)
        schema_engine = gpu.submit(SchemaEngine, engine, background_captures=True).result()
    except KernelsUnavailableError as exc:
        raise ConfigError(str(exc)) from None
    return engine, Scorer(schema_engine, config.schema_memory_bytes, config.tokenizer_threads, gpu_thread=gpu,
                          warmup_state_tokens=config.warmup_state_tokens, max_batch=config.max_batch)


def device_thread() -> ThreadPoolExecutor:
    """The single thread that makes every device call (the GPU lock). Loading the model on it too keeps
    one OpenMP thread team per process on CPU: a second team (one per calling thread) spin-waits
    against the first and, on a 2-core machine, made CPU scoring ~10x slower."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="decider-gpu")


@dataclass
class _Entry:
    future: Future
    pins: int = 0
    nbytes: int = 0
    created_at: float = field(default_factory=time.monotonic)

    def failed_long_ago(self) -> bool:
        return (self.future.done() and self.future.exception() is not None
                and time.monotonic() - self.created_at > FAILED_PREPARE_RETRY_S)


FIRST_SCHEMA_CAPTURE_WAIT_S = 300.0
"""The longest a schema prepared alone (the worker's first) waits for its graphs before scoring goes on beside them."""
EAGER_NOTE_INTERVAL_S = 30.0
"""At most one log line this often for batches that ran without a CUDA graph (each one is a capture's request)."""


@dataclass
class _Launch:
    """A cycle's batch between the GPU thread, which launched it, and the collector, which reads it."""

    outcomes: list[list[ScoredState | None]]    # per job, per state; the unscorable ones filled in already
    ready: list[tuple[int, int, Any, Any]]      # (job, state, prepared schema, tokenized row) of the launched states
    launched_at: float
    pending: Any = None                         # the engine's PendingScores, when the launch succeeded
    results: list[ScoredState] | None = None    # per ready state, once read

    def requests(self) -> list[tuple[Any, Any]]:
        return [(handle, row) for _, _, handle, row in self.ready]


@dataclass
class BatchJob:
    """One schema's batch: the future of its prepared schema and, per state, its tokenized row's future or RowSlot."""

    handle: Future
    rows: list[Any]


class Scorer:
    """Owns the ``SchemaEngine``: prepares schemas on first use, tokenizes off the GPU thread, scores batches.

    ``memory_budget`` bounds the bytes held by prepared schemas (``PreparedSchema.nbytes``); when a new one
    does not fit, the least recently used schemas that no pending state still needs are released.
    """

    def __init__(self, schema_engine: Any, memory_budget: int, tokenizer_threads: int = 2,
                 gpu_thread: ThreadPoolExecutor | None = None, warmup_state_tokens: Sequence[int] = (),
                 max_batch: int = 32) -> None:
        self._se = schema_engine
        self._warmup_state_tokens = tuple(warmup_state_tokens)
        self._max_batch = max_batch
        self._budget = memory_budget
        # Pass the executor the model was loaded on, so every torch call of the process runs on one thread.
        self._gpu = gpu_thread or device_thread()
        self._tokenizers = ThreadPoolExecutor(max_workers=max(1, tokenizer_threads), thread_name_prefix="decider-tok")
        # Waits for launched batches and reads their scores, so that the GPU thread is free to launch the next one.
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decider-collect")
        self._last_ready_at = 0.0  # when the collector last had a batch's scores (collector thread only)
        self._lock = threading.Lock()  # guards _entries between the main thread and the GPU thread
        self._entries: OrderedDict[SchemaKey, _Entry] = OrderedDict()
        self._held_bytes = 0  # by the prepared schemas in _entries
        self._eager_noted_at = -EAGER_NOTE_INTERVAL_S  # when a batch without a graph was last logged (GPU thread)
        # Called (from the GPU thread) as on_event("schema_prepared", {...}); the demo prints it.
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None

    # ---- prepared schemas ------------------------------------------------------------------------------------
    def acquire(self, schema_record: dict[str, Any]) -> Future:
        """A future of the prepared handle for this schema version, prepared on first sight; pins it
        against eviction until ``release_pin``. The future fails with the engine's ValueError if the
        schema cannot be prepared (the failure is remembered for FAILED_PREPARE_RETRY_S: no retry per state)."""
        key: SchemaKey = (schema_record["schema_id"], schema_record["version"])
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pins == 0 and entry.failed_long_ago():
                del self._entries[key]
                entry = None
            if entry is None:
                entry = _Entry(self._gpu.submit(self._prepare, key, engine_questions(schema_record),
                                                engine_options(schema_record)))
                self._entries[key] = entry
            entry.pins += 1
            self._entries.move_to_end(key)
            return entry.future

    def release_pin(self, key: SchemaKey) -> None:
        """Undo one ``acquire``: a pending state no longer needs this schema."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def forget(self, schema_id: str, keep_version: int | None = None) -> None:
        """Release unpinned prepared versions of ``schema_id`` other than ``keep_version`` (new version or
        tombstone); pinned ones go when the budget needs room."""
        self._gpu.submit(self._forget, schema_id, keep_version)

    def _prepare(self, key: SchemaKey, questions: list[dict], options: dict[str, Any]) -> Any:
        handle = self._se.prepare(questions, **options)
        self._se.fingerprint(handle)  # made once per schema version, here on the GPU thread, for every record of it
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.nbytes = int(handle.nbytes)
            self._evict_to_fit(keep=key)
        self._announce(key, handle)
        if self.on_event is not None:
            self.on_event("schema_prepared", {"schema_id": key[0], "version": key[1], "questions": handle.n_questions,
                                              "nbytes": int(handle.nbytes), "held_bytes": self._held_bytes})
        return handle

    def _announce(self, key: SchemaKey, handle: Any) -> None:
        """Have the graphs this schema's batches can run at captured (``SchemaEngine.announce``: every batch bucket up
        to --max-batch, alone and mixed, at the --warmup-state-tokens lengths and those met so far) by the engine's
        capture thread, beside the scoring. Only a schema prepared alone (the worker's first) waits for them: no other
        schema's states to hold up, and its own would otherwise run eagerly while its kernels compile."""
        started = time.perf_counter()
        plan = self._se.announce(handle, max_batch=self._max_batch, state_tokens=self._warmup_state_tokens)
        if not plan:
            return
        if self._se.live_schemas() == 1:
            if not self._se.wait_for_captures(FIRST_SCHEMA_CAPTURE_WAIT_S):
                log.warning("schema %s v%d: its CUDA graphs were not all captured after %.0f s; scoring goes on "
                            "beside the captures", key[0], key[1], FIRST_SCHEMA_CAPTURE_WAIT_S)
            log.info("schema %s v%d: %d CUDA graphs captured before its first batch in %.1f s (no other schema's "
                     "states to hold up)", key[0], key[1], len(plan), time.perf_counter() - started)
        else:
            log.info("schema %s v%d: %d CUDA graphs to capture in the background; its batches run on larger graphs "
                     "or eagerly until then", key[0], key[1], len(plan))

    def _evict_to_fit(self, keep: SchemaKey) -> None:
        """Release least recently used, unpinned schemas until the held bytes fit the budget (lock held)."""
        held = sum(e.nbytes for e in self._entries.values())
        for key in list(self._entries):
            if held <= self._budget:
                break
            entry = self._entries[key]
            if key == keep or entry.pins > 0 or not entry.future.done():
                continue
            self._drop(key)
            held -= entry.nbytes
        if held > self._budget:
            log.warning("prepared schemas hold %.1f MiB, over the %.1f MiB budget: all are in use",
                        held / 2**20, self._budget / 2**20)
        self._held_bytes = held

    def _forget(self, schema_id: str, keep_version: int | None) -> None:
        with self._lock:
            for key in [k for k, e in self._entries.items() if k[0] == schema_id and k[1] != keep_version and e.pins == 0]:
                self._drop(key)
            self._held_bytes = sum(e.nbytes for e in self._entries.values())

    def _drop(self, key: SchemaKey) -> None:
        entry = self._entries.pop(key)
        if entry.future.done() and entry.future.exception() is None:
            self._se.release(entry.future.result())

    # ---- requests --------------------------------------------------------------------------------------------
    def tokenize_many(self, handle_future: Future, texts: Sequence[str], slots: Sequence[RowSlot]) -> None:
        """Tokenize ``texts`` as one job of the tokenizer pool: ``slots[i]`` then holds the row of ``texts[i]``."""
        bind(slots, self._tokenizers.submit(tokenized_rows, self._se, handle_future, list(texts), time.monotonic()))

    def unpadded_count(self, handles: Sequence[Future]) -> int:
        """Of a cycle's states (their prepared schemas' futures, in consume order), how many leading ones the engine
        runs with no padded row (``SchemaEngine.unpadded_count``); all of them while a schema is being prepared."""
        distinct = set(handles)
        if not all(h.done() and h.exception() is None for h in distinct):
            return len(handles)
        prepared = {h: h.result() for h in distinct}
        return self._se.unpadded_count([prepared[h] for h in handles])

    def submit(self, jobs: Sequence[BatchJob], on_launched: Callable[[LaunchTimes], None] | None = None) -> Future:
        """Score a cycle's batches, every schema's states in one mixed GPU batch (the engine reads each row's prefix by
        index): a future of, per job, one ``ScoredState`` per state.

        The GPU thread only launches the batch; the collector thread waits for it and reads the scores. So a cycle
        submitted while the one before it is still on the device is queued right behind it, and the device does not
        wait for the previous cycle's scores to be read, nor for the GPU thread to get the GIL back from the loop.
        ``on_launched(times)`` is called (on the GPU thread) once the batch is queued on the device, with when the
        GPU thread took the cycle, had its tokenized states and had queued it (``LaunchTimes``)."""
        scored: Future = Future()
        if not jobs:  # a cycle of dead letters only: nothing to wait for behind the GPU's queue
            scored.set_result([])
            return scored
        self._gpu.submit(self._launch_jobs, list(jobs), scored, on_launched)
        return scored

    def _launch_jobs(self, jobs: list[BatchJob], scored: Future,
                     on_launched: Callable[[LaunchTimes], None] | None) -> None:
        """(GPU thread) Launch the jobs' ready states; hand the rest of the work to the collector."""
        started, taken_at, cpu_at_take = time.perf_counter(), time.monotonic(), time.thread_time()
        try:
            gathered = self._gather(jobs)
            gathered_at = time.monotonic()
            launch = _Launch(*gathered, time.perf_counter())
            requests = launch.requests()
            if requests:
                before = self._se.graph_stats()
                try:
                    launch.pending = self._se.launch_mixed(requests)
                except Exception as batch_error:
                    launch.results = self._one_by_one(requests, batch_error)
                metrics.LAUNCH_SECONDS.observe(time.perf_counter() - started)
                after = self._se.graph_stats()
                inline = after.get("inline", after["captures"]) - before.get("inline", before["captures"])
                if inline > 0 or (after["eager"] > before["eager"] and after.get("pending", 0) > 0):
                    self._note_path(requests, time.perf_counter() - started, after["eager"] > before["eager"])
                if on_launched is not None:
                    launched_at, cpu_s = time.monotonic(), time.thread_time() - cpu_at_take
                    tokenizers = last_job_times(row for job in jobs for row in job.rows) or (None, None)
                    on_launched(LaunchTimes(taken_at, gathered_at, launched_at, inline, *tokenizers, cpu_s))
            self._collector.submit(self._collect, launch, scored)
        except BaseException as error:  # noqa: BLE001 - the loop must hear of it, not a thread's log
            scored.set_exception(error)

    def _note_path(self, requests: Sequence[tuple[Any, Any]], seconds: float, eager: bool) -> None:
        """(GPU thread) A batch captured a CUDA graph on the stream's path (an engine without background captures: a
        warning), or ran without one while its own is captured beside the stream (at most every
        EAGER_NOTE_INTERVAL_S). A first capture or step at a new length can also compile kernels: seconds."""
        lengths = [len(row.ids) for _, row in requests]
        what = (len(requests), min(lengths), max(lengths), seconds * 1000)
        if not eager:
            log.warning("a batch of %d states (rows of %d to %d tokens: state and answer slots) captured a CUDA graph "
                        "on the stream's path, which held it %.0f ms", *what)
        elif time.monotonic() - self._eager_noted_at >= EAGER_NOTE_INTERVAL_S:
            self._eager_noted_at = time.monotonic()
            log.info("a batch of %d states (rows of %d to %d tokens) ran without a CUDA graph (%.0f ms to launch): none "
                     "captured serves its shape yet; its own is being captured beside the stream", *what)

    def _collect(self, launch: "_Launch", scored: Future) -> None:
        """(Collector thread, in launch order) Wait for a launched batch and turn its scores into outcomes."""
        try:
            if launch.pending is not None:
                try:
                    launch.results = self._checked(launch.requests(), launch.pending.details())
                except Exception as batch_error:  # the device failed the batch: isolate the state at fault
                    launch.results = self._gpu.submit(self._one_by_one, launch.requests(), batch_error).result()
                ready_at = time.perf_counter()
                # the batch started on the device when it was launched or when the batch ahead of it finished
                metrics.ENGINE_SECONDS.observe(ready_at - max(launch.launched_at, self._last_ready_at))
                self._last_ready_at = ready_at
            for (j, i, _, row), outcome in zip(launch.ready, launch.results or []):
                outcome.truncated = bool(getattr(row, "truncated", False))
                launch.outcomes[j][i] = outcome
            scored.set_result(launch.outcomes)
        except BaseException as error:  # noqa: BLE001
            scored.set_exception(error)

    @staticmethod
    def _gather(jobs: list[BatchJob]) -> tuple[list[list[ScoredState | None]], list[tuple[int, int, Any, Any]]]:
        """The jobs' prepared schemas and tokenized rows: (outcomes, with the states that cannot be scored filled in;
        the (job, state, prepared schema, tokenized row) of those that can)."""
        outcomes: list[list[ScoredState | None]] = [[None] * len(job.rows) for job in jobs]
        ready: list[tuple[int, int, Any, Any]] = []
        for j, job in enumerate(jobs):
            try:
                handle = job.handle.result()  # prepared earlier on the GPU thread: already done
            except Exception as error:
                message = f"the engine rejected the schema: {error}"
                outcomes[j] = [ScoredState(reason=Reason.SCHEMA_UNPREPARABLE, error=message) for _ in job.rows]
                continue
            for i, row_future in enumerate(job.rows):
                try:
                    ready.append((j, i, handle, row_future.result()))
                except Exception as error:
                    outcomes[j][i] = ScoredState(reason=Reason.SCORING_ERROR, error=f"tokenization failed: {error!r}")
        return outcomes, ready

    def _one_by_one(self, requests: list[tuple[Any, Any]], batch_error: Exception) -> list[ScoredState]:
        """(GPU thread) The batch failed: score each state alone, so that only the state at fault fails."""
        log.warning("batch of %d failed (%r); scoring its states one by one", len(requests), batch_error)
        outcomes = []
        for request in requests:
            try:
                outcomes.extend(self._checked([request], self._se.launch_mixed([request]).details()))
            except Exception as error:
                outcomes.append(ScoredState(reason=Reason.SCORING_ERROR, error=f"{type(error).__name__}: {error}"))
        return outcomes

    @staticmethod
    def _checked(requests: list[tuple[Any, Any]], results: list[Any]) -> list[ScoredState]:
        """The engine's ``StateScores`` as outcomes, a state whose probabilities are unusable as a scoring error."""
        outcomes, known = [], {}        # per schema, its option counts and fingerprint record: made once a batch
        for (handle, _), scores in zip(requests, results):
            n_options, fingerprint = known.get(id(handle)) or known.setdefault(id(handle), (
                list(handle.n_options), handle.fingerprint.as_record() if handle.fingerprint is not None else None))
            problem = probabilities_problem(scores.probabilities, n_options, scores.label_mass)
            if problem:
                outcomes.append(ScoredState(reason=Reason.SCORING_ERROR, error=f"unusable engine output: {problem}"))
            else:
                outcomes.append(ScoredState(scores.probabilities, scores.raw_probabilities, scores.label_mass,
                                            fingerprint=fingerprint))
        return outcomes

    def graph_stats(self) -> dict[str, int]:
        """The engine's path counters: CUDA graph ``captures`` and ``replays`` (0 off CUDA) and ``eager`` batches."""
        return self._se.graph_stats()

    def prepared(self) -> tuple[int, int]:
        """How many schema versions are held prepared, and their device bytes."""
        with self._lock:
            return len(self._entries), self._held_bytes

    def bank_bytes(self) -> int:
        """Device bytes of the engine's prefix bank (what prepared schemas really hold: it never shrinks)."""
        return int(self._se.memory()["bank_bytes"])

    def close(self) -> None:
        """Stop the threads (queued work is cancelled; the running step finishes)."""
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        self._gpu.shutdown(wait=True, cancel_futures=True)
        self._collector.shutdown(wait=True, cancel_futures=True)
        self._se.close()  # the engine's capture thread, if it has one
