"""RoPE's angles from the table (`engine.rope_table`) are the module's, bit for bit, at any positions; a step whose
positions the table does not cover (or a setting off) computes them with the module; the scores are the same either
way."""
import torch

import engine.rope_table as rope_table
from engine import SchemaEngine
from engine.rope_table import RopeTable
from tests.engine.conftest import make_questions, make_states


def test_the_table_gives_the_modules_angles_bit_for_bit(eng):
    rotary = eng.model.model.rotary_emb
    for dtype in (torch.float32, torch.bfloat16):
        table = RopeTable(rotary, 4096, dtype, torch.device("cpu"))
        assert table.cos is not None and table.cos.shape[0] == 4096
        positions = torch.tensor([[0, 1, 2, 3], [517, 518, 519, 520], [4092, 4093, 4094, 4095]])
        h = torch.empty(3, 4, 8, dtype=dtype)
        got = table(h, positions, 4096)
        want = rotary(h, positions[None].expand(3, -1, -1))
        assert got[0].dtype == dtype and got[0].shape == want[0].shape
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert got[0].data_ptr() != want[0].data_ptr()


def test_positions_past_the_table_come_from_the_module(eng, monkeypatch):
    rotary = eng.model.model.rotary_emb
    table = RopeTable(rotary, 16, torch.float32, torch.device("cpu"))
    calls = []
    monkeypatch.setattr(table, "rotary_emb", lambda h, p: calls.append(p) or rotary(h, p))
    positions = torch.arange(20)[None]
    cos, sin = table(torch.empty(1, 20, 8), positions, 20)       # a bound past the table's 16 positions
    assert len(calls) == 1 and cos.shape[1] == 20
    table(torch.empty(1, 4, 8), positions[:, :4], 16)
    assert len(calls) == 1                                        # covered: the table, not the module


def test_scores_are_the_same_with_the_table_and_without(eng, monkeypatch):
    qs = make_questions([4, 2, 3])
    states = make_states(5, seed=3)
    assert eng.forward.rope.cos is not None                        # the table is there to be taken
    with_table = SchemaEngine(eng, use_graphs=False)
    got = with_table.score(with_table.prepare(qs), states)
    monkeypatch.setattr(rope_table, "ROPE_TABLE", False)
    without = SchemaEngine(eng, use_graphs=False)
    want = without.score(without.prepare(qs), states)
    assert all(torch.equal(g, w) for a, b in zip(got, want) for g, w in zip(a, b))
