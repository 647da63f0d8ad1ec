"""Named error types of the worker, by what the caller must do about them.

- ``RetriableError``: a service the record does not control (the Schema Registry) failed for now; try the same
  record again, never dead-letter it for that.
- ``AbortableError``: the open transaction is lost; abort it, rewind the consumer to the last
  committed offsets and process the records again. No output of the aborted attempt is ever visible.
- ``FatalError``: this process cannot go on (fenced by a newer instance, bad configuration, bad model
  path); exit non-zero with the message, which is written for a user to act on.

Retriable Kafka errors have no type here: ``worker.stream.transactions`` retries what librdkafka marks retriable, within
the transaction timeout, and turns what is left into one of these.

Exit codes of ``decider worker``: 1 fatal, 2 configuration, 3 fenced, 4 broker or topic unavailable at start,
5 the broker stayed unreachable longer than --broker-outage-s, or a Kafka client call hung past its timeout
(``worker.stream.transactions``' watchdog exits the process directly, since the hung call cannot be interrupted; restart
to recover).
"""

from __future__ import annotations


class DeciderError(Exception):
    """Base of every error the worker raises on purpose."""


class RetriableError(DeciderError):
    """A transient failure outside the record; retry the same operation."""


class AbortableError(DeciderError):
    """The current transaction must be aborted and its input re-read from the committed offsets."""


class FatalError(DeciderError):
    """The process must stop; ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1
    reported: bool = False
    """Already told to the user (as a JSON log event, under --log-format json): the CLI prints nothing more."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class FencedError(FatalError):
    """Another process with the same --worker-id (transactional id) took over; this one must stop."""

    exit_code = 3


class ConfigError(FatalError):
    """A flag, environment variable, file or model path is unusable."""

    exit_code = 2

    @classmethod
    def device_unavailable(cls, device: str, reason: str) -> "ConfigError":
        """--device names a device this machine does not have (``reason``: the engine's why)."""
        return cls(f"--device {device}: {reason}; on a machine without a GPU, use --device cpu")


class BrokerUnavailableError(FatalError):
    """No broker answered at the bootstrap address, or a required topic is missing."""

    exit_code = 4


class BrokerOutageError(FatalError):
    """The broker stayed unreachable longer than --broker-outage-s; the worker gives up (a restart resumes)."""

    exit_code = 5
