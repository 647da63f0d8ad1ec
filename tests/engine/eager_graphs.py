"""A graph manager whose "graphs" run their step eagerly at replay: the manager's bookkeeping (what is captured, where,
when, what serves what, what a clear drops) on the CPU, where CUDA graphs do not exist. `gate` holds its captures
back (a test then sees what the scoring does while a capture is still to come); `delay_s` makes each one slow."""
from __future__ import annotations

import threading
import time

from engine.graphs import CapturedStep, GraphManager


class _EagerGraph:
    def __init__(self, fn, static):
        self.fn, self.static, self.output = fn, static, None
        self.began = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.began = True

    def replay(self):
        self.output.copy_(self.fn(*self.static))


class _EagerStep(CapturedStep):
    def replay(self, *values):
        return super().replay(*values).clone()      # as a CUDA step's caller copies the static output before reading


class EagerGraphs(GraphManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.delay_s = 0.0
        self.threads: list[str] = []              # the thread each capture ran on
        self.before_begin = None                  # called inside a capture, after its warm-up (e.g. a `clear`)

    @staticmethod
    def _new_pool():
        return object()

    def _record(self, example, fn, keep, begin, host_wait=False):
        self.gate.wait()
        time.sleep(self.delay_s)
        self.threads.append(threading.current_thread().name)
        static = tuple(x.clone() for x in example)
        fn(*static)                                # the warm-up run
        if self.before_begin is not None:
            self.before_begin()
        graph = _EagerGraph(fn, static)
        if not begin(graph):
            return None
        graph.output = fn(*static)
        return _EagerStep(graph, static, graph.output, keep), 0


def background_engine(eng, **kwargs):
    """A SchemaEngine with background captures whose graphs are `EagerGraphs` (enabled on the CPU)."""
    from engine import SchemaEngine

    se = SchemaEngine(eng, background_captures=True, **kwargs)
    se.graphs = EagerGraphs(enabled=True, device=eng.dev, background=True, serves=se.graphs.serves)
    return se
