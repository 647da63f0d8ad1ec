"""The graph manager's bucket table and counters on the CPU (capture and replay are test_gpu.py's)."""
import torch

from engine.buckets import B_BUCKETS, TS_BUCKETS, batch_buckets
from engine.graphs import GraphManager, StepShape

from .conftest import make_questions, make_states


def test_batch_buckets_cover_every_batch_up_to_max_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32]
    assert batch_buckets(44) == [*batch_buckets(32), 40, 48]     # 41-48 states run in the 48 graph
    assert batch_buckets(1000) == list(B_BUCKETS)            # chunks of 128 and any remainder


def test_shapes_pad_to_buckets_and_fall_back_to_eager_past_them():
    g = GraphManager(enabled=True)
    assert g.shape(17, 182) == StepShape(20, 184, graphed=True)
    assert g.shape(5, 182) == StepShape(5, 184, graphed=True)
    assert g.shape(1, 5) == StepShape(1, 32, graphed=True)
    assert g.shape(3, TS_BUCKETS[-1] + 1) == StepShape(3, TS_BUCKETS[-1] + 1, graphed=False)
    assert g.shape(B_BUCKETS[-1] + 1, 40) == StepShape(B_BUCKETS[-1] + 1, 40, graphed=False)
    assert GraphManager(enabled=False).shape(17, 182) == StepShape(17, 182, graphed=False)


def test_warmup_order_is_largest_first_one_shape_per_bucket():
    g = GraphManager(enabled=True)
    order = g.warmup_order([1, 8, 9, 10], [100, 97, 60])
    assert order == [StepShape(10, 104, True), StepShape(10, 64, True), StepShape(8, 104, True), StepShape(8, 64, True),
                     StepShape(1, 104, True), StepShape(1, 64, True)]
    assert GraphManager(enabled=False).warmup_order([1, 8], [100]) == []


def test_eager_steps_are_counted_and_sliced():
    g = GraphManager(enabled=False)
    shape = g.shape(3, 10)
    out = g.run(("k",), shape, (torch.arange(12.0).view(6, 2),), lambda s: ((lambda x: x * 2), None), out_rows=4)
    assert torch.equal(out, torch.arange(8.0).view(4, 2) * 2)
    assert g.stats == {"captures": 0, "replays": 0, "eager": 1, "covered": 0, "inline": 0}
    assert len(g) == 0 and not g.holds(("k",), shape)         # an eager step keeps nothing


def test_schema_engine_reports_its_graph_stats(eng):
    from engine import SchemaEngine

    se = SchemaEngine(eng)
    h = se.prepare(make_questions([2, 3]))
    none = {"captures": 0, "replays": 0, "eager": 0, "covered": 0, "inline": 0, "graphs": 0, "pending": 0}
    assert se.graph_stats() == none
    se.score(h, make_states(3))
    se.score(h, make_states(2, seed=1))
    assert se.graph_stats() == {**none, "eager": 2}
    assert se.warmup(h, batch_sizes=(1, 8), state_tokens=(32,)) >= 0 and se.graph_stats()["eager"] == 2


def test_step_layout_stages_rows_and_unstages_views_of_the_same_values():
    import numpy as np

    from engine.prompt import MAX_OPTIONS
    from engine.step_layout import Row, StepLayout

    bias = np.zeros((2, MAX_OPTIONS), dtype=np.float32)
    bias[0, :2], bias[1, 0], bias[1, -1] = (0.5, -1.0), 0.25, 3.0
    rows = [Row(3, np.array([5, 6, 7]), [1, 2], [0.5, 2.0], [2, 4], bias), Row(1, [8, 9], [0], [1.25], [3])]
    layout = StepLayout(R=3, T=4, A=6)                 # one padding row; rows may hold 2 answers
    staged = layout.stage(rows, pad=0, pin=False)
    assert staged.dtype == torch.int64 and staged.numel() == layout.size
    ids, slots, flat, n_options, (starts, counts), inv_temp, biases = layout.unstage(staged)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [0, 0, 0, 0]]
    assert slots.tolist() == [3, 1, 3]                 # the padding row continues row 0's prefix
    assert flat.tolist() == [1, 2, 4, 0, 0, 0]         # answer positions in the flattened [R, T] ids
    assert n_options.tolist() == [2, 4, 3, MAX_OPTIONS, MAX_OPTIONS, MAX_OPTIONS]
    assert starts.tolist() == [0, 2, 0] and counts.tolist() == [2, 1, 0]
    assert inv_temp.dtype == torch.float32 and inv_temp.tolist() == [0.5, 2.0, 1.25, 1.0, 1.0, 1.0]
    assert biases.shape == (6, MAX_OPTIONS) and biases.dtype == torch.float32
    assert biases[:2].tolist() == bias.tolist() and not biases[2:].any()     # rows without a bias, padding: 0
