"""``decider demo``: the whole pipeline on this machine, narrated in the terminal.

Embedded broker -> topics -> example schema (support tickets) -> example states -> a CPU worker in this
process -> the committed records read back as a read_committed reader sees them. Everything it starts
it stops, including on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from importlib.resources import files
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from worker.cli import commands
from worker.config import Topics, WorkerConfig
from worker.devbroker.embedded_broker import EmbeddedBroker
from worker.devbroker.processes import free_port
from worker.exceptions import FatalError
from worker.kafka_clients import create_topics
from worker.devbroker.reaper import Reaper
from worker.cli.user_files import read_state_lines

EXAMPLES = files("worker").joinpath("examples")


def run_demo(model_dir: str | None = None, port: int | None = None, records_shown: int = 3, timeout_s: float = 180.0) -> None:
    """Run the demo end to end; raises ``FatalError`` if the pipeline does not deliver every record."""
    # The worker runs in this process: OpenMP must wait passively (see worker.stream.scorer.load_scorer), and
    # that is only read when torch first starts OpenMP, so set it before anything imports torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    console = Console(highlight=False)
    scratch = Path(tempfile.mkdtemp(prefix="decider-demo-"))
    reaper = Reaper([], [str(scratch)])  # deletes the scratch dir even if the demo is killed with SIGKILL
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        # data_dir None: the broker's own temporary dir, which it deletes (or its reaper) however the demo ends
        with EmbeddedBroker(port=port or free_port()) as broker:
            console.rule("[bold]decider demo")
            console.print(f"[green]✓[/] embedded Kafka broker (noida-db) on [bold]{broker.bootstrap}[/]")
            topics = Topics()
            for name, outcome in create_topics(broker.bootstrap, topics, partitions=2).items():
                console.print(f"[green]✓[/] topic [bold]{name}[/] {outcome}")
            model = model_dir or _tiny_model(console, scratch / "tiny-model")

            schema_file = Path(str(EXAMPLES.joinpath("support_schema.json")))
            record, _published = commands.put_schema(broker.bootstrap, topics, "support", schema_file)
            console.print(f"[green]✓[/] schema [bold]support[/] v{record['version']} published: "
                          + ", ".join(q["id"] for q in record["questions"]))
            states = read_state_lines(Path(str(EXAMPLES.joinpath("support_states.jsonl"))), "support")
            commands.produce_states(broker.bootstrap, topics, states)
            console.print(f"[green]✓[/] {len(states)} support tickets published to [bold]{topics.states}[/]")

            progress = _Progress(console, expected=len(states))
            config = WorkerConfig(bootstrap=broker.bootstrap, model_dir=str(model), worker_id="demo", device="cpu",
                                  max_batch=8, max_wait_ms=100, schema_wait_ms=2000)
            thread = _start_worker(config, stop, progress)
            console.print("[cyan]…[/] worker starting (loading the model)")
            if not progress.done.wait(timeout_s):
                raise FatalError(f"the worker delivered {progress.outputs} of {len(states)} records within {timeout_s:.0f} s")
            if progress.error is not None:
                raise progress.error
            _show_records(console, broker.bootstrap, topics, len(states), records_shown)
            stop.set()
            thread.join(30)
            console.print("[green]✓[/] worker stopped; broker stopping")
        console.rule("[bold]done")
        console.print("Next, the same by hand (README, Stream): [bold]decider tiny-model DIR[/], [bold]decider broker[/], "
                      "[bold]decider topics create[/], [bold]decider schema put[/], [bold]decider worker[/], "
                      "[bold]decider produce[/] and [bold]decider tail[/] (see --help).")
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
        shutil.rmtree(scratch, ignore_errors=True)
        reaper.release()


def _tiny_model(console: Console, path: Path) -> Path:
    from engine.testing import write_tiny_model

    write_tiny_model(path, seed=0)
    console.print("[green]✓[/] tiny random Qwen3.5-family model written [dim](random weights: the numbers are "
                  "meaningless, the pipeline is real; pass --model DIR for a real model)[/]")
    return path


class _Progress:
    """Prints the worker's events and notices when every state has an output."""

    def __init__(self, console: Console, expected: int) -> None:
        self.console, self.expected, self.outputs = console, expected, 0
        self.done = threading.Event()
        self.error: BaseException | None = None

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "model_loaded":
            self.console.print(f"[green]✓[/] model [bold]{info['model_id']}[/] loaded on {info['device']}")
        elif kind == "assigned":
            self.console.print(f"[green]✓[/] worker joined the group: partitions {info['partitions']}")
        elif kind == "schema_prepared":
            self.console.print(f"[green]✓[/] schema [bold]{info['schema_id']}[/] v{info['version']} prepared: "
                               f"{info['questions']} questions, prefix cache {info['nbytes'] / 1024:.0f} KiB")
        elif kind == "committed" and (info["scored"] or info["dead_letters"]):
            self.outputs += info["scored"] + sum(info["dead_letters"].values())
            batches = ", ".join(f"{k}: {n}" for k, n in info["batches"].items())
            self.console.print(f"[green]✓[/] batch committed ({batches}) → {info['scored']} records, "
                               f"{sum(info['dead_letters'].values())} dead letters, offsets {info['offsets']}, "
                               f"commit {info['commit_ms']:.1f} ms")
            if self.outputs >= self.expected:
                self.done.set()
        elif kind == "aborted":
            self.console.print(f"[yellow]![/] transaction aborted, rewinding: {info['error']}")


def _start_worker(config: WorkerConfig, stop: threading.Event, progress: _Progress) -> threading.Thread:
    from worker.stream.loop import Worker

    def run() -> None:
        try:
            Worker(config, stop=stop, on_event=progress).run()
        except BaseException as exc:  # surfaced to the main thread, which prints it
            progress.error = exc
            progress.done.set()

    thread = threading.Thread(target=run, name="decider-demo-worker", daemon=True)
    thread.start()
    return thread


def _show_records(console: Console, bootstrap: str, topics: Topics, expected: int, shown: int) -> None:
    records = list(commands.tail(bootstrap, topics.probabilities, "probabilities", from_beginning=True,
                                max_records=expected, idle_timeout_s=10))
    console.print(f"[green]✓[/] read back {len(records)} committed records from [bold]{topics.probabilities}[/] (read_committed)")
    for record in sorted(records, key=lambda r: r["state_id"])[:shown]:
        table = Table(title=f"{record['state_id']} · schema {record['schema_id']} v{record['schema_version']} · "
                            f"{record['source_topic']}[{record['source_partition']}]@{record['source_offset']}",
                      title_justify="left", show_header=True)
        table.add_column("question")
        table.add_column("probabilities")
        for question in record["questions"]:
            cells = "  ".join(f"{o} {p:.2f}" for o, p in zip(question["options"], question["probabilities"]))
            table.add_row(question["id"], cells)
        console.print(table)
