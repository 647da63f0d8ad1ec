"""The staging buffers' pool (`engine.pinned_pool`): a buffer comes back only once the device has passed its event,
oldest first, at most `per_size` kept, nothing while the pool is off; and a reused buffer, whatever it held, stages a
step's rows as a fresh one does. (On CUDA the GPU tests score through it; here events and allocations are stand-ins.)"""
import numpy as np
import pytest
import torch

import engine.pinned_pool as pinned_pool
from engine.pinned_pool import PinnedPool
from engine.step_layout import Row, StepLayout


class Event:
    def __init__(self, passed: bool = False):
        self.passed = passed

    def query(self) -> bool:
        return self.passed


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(pinned_pool, "STAGING_POOL", True)
    made = []
    return PinnedPool(lambda numel, dtype: made.append(torch.empty(numel, dtype=dtype)) or made[-1], per_size=2), made


def test_a_buffer_is_taken_again_only_after_its_event_has_passed(pool):
    pool, made = pool
    a, b = pool.take(10, torch.int64), pool.take(10, torch.int64)
    first, second = Event(), Event()
    pool.give_back([a], first)
    pool.give_back([b], second)
    assert pool.take(10, torch.int64) is made[-1] is not a            # a's launch still running: a new one
    second.passed = True
    taken = pool.take(10, torch.int64)
    assert taken is not a and taken is not b                           # the oldest (a) first: b waits behind it
    first.passed = True
    assert pool.take(10, torch.int64) is a and pool.take(10, torch.int64) is b
    assert pool.take(12, torch.int64) is made[-1]                      # another size: its own queue
    assert len(made) == 5


def test_the_pool_keeps_per_size_buffers_and_none_when_off_or_without_an_event(pool, monkeypatch):
    pool, made = pool
    buffers = [pool.take(4, torch.int64) for _ in range(3)]
    pool.give_back(buffers, Event(passed=True))
    again = [pool.take(4, torch.int64) for _ in range(3)]
    assert again[0] is buffers[0] and again[1] is buffers[1] and again[2] is made[-1] and len(made) == 4
    pool.give_back([made[0]], None)                                    # off CUDA: no event, nothing kept
    assert pool.take(4, torch.int64) is made[-1] and len(made) == 5
    monkeypatch.setattr(pinned_pool, "STAGING_POOL", False)
    pool.give_back([made[0]], Event(passed=True))
    monkeypatch.setattr(pinned_pool, "STAGING_POOL", True)
    assert pool.take(4, torch.int64) is made[-1] and len(made) == 6


def test_a_reused_buffer_stages_the_rows_as_a_fresh_one():
    bias = np.full((2, 26), 0.5, dtype=np.float32)
    rows = [Row(3, np.array([5, 6, 7]), [1, 2], [0.5, 2.0], [2, 4], bias), Row(1, [8, 9], [0], [1.25], [3])]
    layout = StepLayout(R=3, T=4, A=6)
    fresh = layout.stage(rows, pad=0, pin=False)
    dirty = torch.full((layout.size,), -7, dtype=torch.int64)
    reused = layout.stage(rows, pad=0, pin=False, buffer=dirty)
    assert reused is dirty
    # every section a step reads (the float section's last half-element, if any, is never read)
    readable = layout.size if (layout.A * 27) % 2 == 0 else layout.size - 1
    assert torch.equal(reused[:readable], fresh[:readable])
    assert torch.equal(layout.unstage(reused)[-1], layout.unstage(fresh)[-1])          # the option biases, whole
