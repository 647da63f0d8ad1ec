"""Running a loop (worker or replay) as an operated process: stop on signals, its events logged, counted in the
metrics and driving readiness (``worker.ops.health``, on ``--metrics-port``), and a fatal end told once: an ``error:``
line (``worker.cli.errors``), or under --log-format json a JSON event instead."""

from __future__ import annotations

import faulthandler
import functools
import logging
import signal
import threading
from typing import Callable

from worker.stream.assignment import EventSink
from worker.config import WorkerConfig
from worker.config_file import redact, redact_text
from worker.exceptions import FatalError, FencedError


def stop_on_signals() -> threading.Event:
    """SIGTERM and SIGINT set the returned flag; the loop then drains and exits cleanly."""
    stop = threading.Event()

    def request_stop(signum, _frame):
        logging.getLogger("decider").info("%s received: finishing the open batch and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # kill -USR1 <pid> prints every thread's stack to stderr: where a stuck worker is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


def run_logged(run: Callable[[EventSink], None], config: WorkerConfig, commits_at: int = logging.INFO) -> None:
    """Run a loop with its events logged, counted in the metrics and driving /readyz. A fatal end is logged as an event
    only where logs are JSON (for log shippers, and marked ``reported``); a person reading human logs gets the CLI's one
    ``error:`` line, not that line twice (the event, then the error). ``commits_at``: the level of each transaction's
    ``committed`` line."""
    from worker.ops import logs, metrics

    health = None
    if config.metrics_port:
        from worker.ops.health import Health, serve

        health = Health()
        serve(config.metrics_port, health, config.metrics_host)
    if config.kafka:
        logging.getLogger("decider").info("kafka client settings from the config file: %s", redact(config.kafka))
    if config.registry is not None:
        from worker.formats.registry import redacted_registry_settings

        logging.getLogger("decider").info("schema registry %s, client settings %s", config.registry.shown_url(),
                                          redacted_registry_settings(config.registry.settings))
    sinks = [functools.partial(logs.log_event, committed_level=commits_at), metrics.on_event]
    sinks += [health.on_event] if health else []

    def on_event(kind: str, info: dict) -> None:
        for sink in sinks:
            sink(kind, info)

    try:
        run(on_event)
    except FatalError as exc:
        if logs.writes_json():
            kind = "fenced" if isinstance(exc, FencedError) else "fatal"
            message = redact_text(str(exc), config.kafka)
            logs.log_fatal(kind, config.registry.redact(message) if config.registry else message, exc.exit_code)
            exc.reported = True
        raise
