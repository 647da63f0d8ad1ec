"""Which of a running worker's threads hold the GIL, and where: py-spy's ``--gil`` samples, summarised.

The stream's latency is made of the worker's threads taking turns at the GIL (the loop, the GPU thread that queues
batches, the collector that reads scores, the tokenizers): a thread that needs it to queue a batch waits for
whichever one holds it. ``py-spy record --gil`` samples only the thread holding the GIL, so the samples of a thread
over the samples taken say what share of the wall time it held it, and its stacks say where.

    python bench/gil_profile.py RAW            # summarise a py-spy raw file (``--format raw --threads``)

``bench/stream_bench.py --gil-profile`` records worker 0 during each budget phase's measured window and puts the
summary in the phase's result (``worker0_gil``). py-spy is not a dependency of the project: ``pip install py-spy``
(a wheel; on the GPU machine it travels in ``.whl/``). It needs the right to ptrace the worker (root, or
``kernel.yama.ptrace_scope`` 0); without py-spy or that right the summary says why instead.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

RATE_HZ = 250
"""Samples a second: py-spy's default is 100; the GIL changes hands every few hundred microseconds."""

_PROJECT_DIRS = ("worker/", "engine/")


def py_spy() -> str | None:
    """The py-spy executable: on PATH, beside this Python, or in a ``bin`` beside a PYTHONPATH entry (``pip install
    --target``, as the GPU machine's set-up does); None if there is none."""
    candidates = [shutil.which("py-spy"), str(Path(sys.executable).parent / "py-spy")]
    candidates += [str(Path(entry) / "bin" / "py-spy") for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def record(pid: int, seconds: float, raw_path: Path) -> subprocess.Popen | None:
    """Start sampling process ``pid``'s GIL holder for ``seconds`` into ``raw_path`` (in the background); None without
    py-spy."""
    exe = py_spy()
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--gil", "--threads", "--nonblocking", "-r",
                             str(RATE_HZ), "-d", str(max(1, round(seconds))), "--format", "raw", "-o", str(raw_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


ENGINE_FRAMES = r"^step \((?:.*/)?engine/schema_engine\.py|\((?:.*/)?engine/(?:model|readout|label_mass)\.py|\((?:.*/)?engine/kernels/"
"""A frame of the engine's own compute (the step's forward and read-out, the kernels): a sample with one below it is
the engine's, not the host's (on the GPU the step is a graph's replay)."""


def summarize(raw: str, seconds: float, top: int = 15, engine_frames: str = ENGINE_FRAMES) -> dict:
    """py-spy raw output (``--gil --threads``) over ``seconds`` -> per thread name, the share of the wall time it held
    the GIL; the share held inside the engine's compute (a frame matching ``engine_frames`` on the stack) and outside
    it; and the ``top`` places holding it: per thread, the deepest frame of the project's code (``worker/``,
    ``engine/``), or the innermost frame where none is."""
    by_thread: collections.Counter = collections.Counter()
    by_place: collections.Counter = collections.Counter()
    engine = 0
    in_engine = re.compile(engine_frames)
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(":", 1)[-1].strip() if frames[0].startswith("thread") else "?"
        ours = [f for f in frames[1:] if any(f"({d}" in f for d in _PROJECT_DIRS)]
        by_thread[thread] += int(count)
        by_place[(thread, ours[-1] if ours else frames[-1])] += int(count)
        engine += int(count) if any(in_engine.search(f) for f in frames[1:]) else 0
    taken = RATE_HZ * seconds
    held = sum(by_thread.values())
    share = lambda n: round(n / taken, 4) if taken else None  # noqa: E731
    return {"seconds": seconds, "gil_held_share": share(held), "engine_share": share(engine),
            "non_engine_share": share(held - engine),
            "by_thread": {t: share(c) for t, c in by_thread.most_common()},
            "top": [{"thread": t, "where": w, "share": share(c)} for (t, w), c in by_place.most_common(top)]}


def finish(sampler: subprocess.Popen | None, raw_path: Path, seconds: float, engine_frames: str = ENGINE_FRAMES) -> dict:
    """Wait for ``record``'s sampler and summarise what it wrote (or say why there is nothing)."""
    if sampler is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    _, err = sampler.communicate(timeout=seconds + 60)
    if sampler.returncode != 0 or not raw_path.exists():
        return {"error": f"py-spy exited {sampler.returncode}: {err.strip()[-300:]}"}
    return summarize(raw_path.read_text(), seconds, engine_frames=engine_frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="py-spy record --gil --threads --format raw output")
    ap.add_argument("--seconds", type=float, required=True, help="how long it sampled (-d)")
    args = ap.parse_args()
    print(json.dumps(summarize(args.raw.read_text(), args.seconds), indent=1))


if __name__ == "__main__":
    main()
