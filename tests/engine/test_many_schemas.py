"""Many schemas at once: one batch reads each row's prefix from the prefix bank by index, so states of any mix of
schemas score together, as they would alone (deterministic tables: bit for bit)."""
import random

import pytest
import torch

from engine import Engine, SchemaEngine
from engine.reference import score_full

from .conftest import make_questions, make_states

# float32 on the CPU: another batch changes only the reduction order, by how much depends on the CPU's BLAS kernels:
# up to 4.3e-6 over six seeds on an AMD EPYC (2.5e-6 with the seeds below, over the 2e-6 this bound once was). Still
# 5x under the bound against the full-forward oracle (1e-4, next test)
CPU_ATOL = 2e-5


def _schemas(se, n: int, seed: int = 0):
    """n schemas of different shapes: question counts, option counts, prefix lengths and both modes."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        options = [rnd.randint(2, 8) for _ in range(rnd.randint(1, 6))]
        temps = [rnd.choice([0.5, 1.0, 2.0]) for _ in options]
        out.append(se.prepare(make_questions(options, temperatures=temps), independent=i % 3 == 2))
    return out


def _mixed_requests(se, schemas, states, seed: int = 1):
    rnd = random.Random(seed)
    picks = [rnd.choice(schemas) for _ in states]
    return [(h, se.tokenize(h, s)) for h, s in zip(picks, states)]


def _max_diff(a, b) -> float:
    return max(abs(x - y) for sa, sb in zip(a, b) for qa, qb in zip(sa, sb) for x, y in zip(qa, qb))


def test_a_mixed_batch_scores_each_state_as_its_schema_alone(eng):
    se = SchemaEngine(eng)
    schemas = _schemas(se, 7)
    requests = _mixed_requests(se, schemas, make_states(30, seed=2))
    mixed = se.score_mixed(requests)
    alone = [se.score_lists(h, [row])[0] for h, row in requests]
    assert [len(m) for m in mixed] == [h.n_questions for h, _ in requests]
    assert [[len(q) for q in m] for m in mixed] == [h.n_options for h, _ in requests]
    assert _max_diff(mixed, alone) < CPU_ATOL


def test_a_mixed_batch_matches_the_oracle(eng):
    se = SchemaEngine(eng)
    schemas = _schemas(se, 4, seed=3)
    states = make_states(12, seed=4)
    requests = _mixed_requests(se, schemas, states, seed=5)
    mixed = se.score_mixed(requests)
    for (h, _), state, got in zip(requests, states, mixed):
        qs = [{"question": q.text, "options": list(q.options), "temperature": q.temperature} for q in h.questions]
        want = score_full(eng, qs, [state], independent=h.independent)[0]
        for q, probs in enumerate(got):
            torch.testing.assert_close(torch.tensor(probs), want[q, :len(probs)], rtol=0, atol=1e-4)


def test_deterministic_mixed_batches_are_bit_identical_to_alone(tiny_dir):
    se = SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True))
    schemas = _schemas(se, 5, seed=6)
    requests = _mixed_requests(se, schemas, make_states(14, seed=7), seed=8)
    mixed = se.score_mixed(requests)
    alone = [se.score_lists(h, [row])[0] for h, row in requests]
    assert mixed == alone


def test_the_bank_grows_and_reuses_released_slots(eng):
    se = SchemaEngine(eng, prefix_slots=2)
    first = se.prepare(make_questions([2, 3]))
    states = make_states(5, seed=9)
    before = se.score_lists(first, [se.tokenize(first, s) for s in states])
    more = _schemas(se, 6, seed=10)                     # past 2 slots: the bank doubles, copying what it holds
    assert se.memory()["slots"] >= 1 + sum(h.P for h in more) and se.bank.generation > 1
    # the conv states stay time-major through the copy ([S, C, K-1] views of [S, K-1, C]: the conv kernel's vector reads)
    assert se.bank.conv and all(t.transpose(1, 2).is_contiguous() for t in se.bank.conv.values())
    assert se.score_lists(first, [se.tokenize(first, s) for s in states]) == before
    live = se.memory()["live_slots"]
    se.release(more[0])
    assert se.memory()["live_slots"] == live - more[0].P
    again = se.prepare(make_questions([4]))
    assert again.prefix_slots[0] in more[0].prefix_slots            # a released slot is reused, no growth
    assert se.score_lists(first, [se.tokenize(first, s) for s in states]) == before


def test_a_longer_prefix_grows_the_token_capacity(eng):
    se = SchemaEngine(eng)
    short = se.prepare(make_questions([2]))
    tokens = se.memory()["bank_bytes"], se.bank.capacity_tokens
    states = make_states(4, seed=11)
    before = se.score_lists(short, [se.tokenize(short, s) for s in states])
    long_questions = [{"question": f"{i}: is this about " + " ".join(["the delivery"] * 120) + "?",
                       "options": ["yes", "no"]} for i in range(3)]
    long = se.prepare(long_questions)
    assert long.prefix_tokens > tokens[1] and se.bank.capacity_tokens >= long.prefix_tokens
    assert se.score_lists(short, [se.tokenize(short, s) for s in states]) == before
    got = se.score_lists(long, [se.tokenize(long, states[0])])[0]
    want = score_full(eng, long_questions, states[:1])[0]
    for q in range(3):
        torch.testing.assert_close(torch.tensor(got[q]), want[q, :2], rtol=0, atol=1e-4)


def test_prepared_schema_memory_is_reported(eng):
    se = SchemaEngine(eng)
    packed, independent = se.prepare(make_questions([2, 3])), se.prepare(make_questions([2, 3, 4]), independent=True)
    memory = se.memory()
    assert memory["live_slots"] == 4 and memory["slot_bytes"] > 0
    assert packed.nbytes == memory["slot_bytes"] and independent.nbytes == 3 * memory["slot_bytes"]
    assert memory["bank_bytes"] == memory["slots"] * memory["slot_bytes"]


def test_an_empty_mixed_batch_is_refused(eng):
    from engine import InputError

    with pytest.raises(InputError):
        SchemaEngine(eng).score_mixed([])


def _answer_attention_by_answer(q, k, v, bank_k, bank_v, key_lengths, slots, rows, starts, counts, gate, scale):
    """`Kernels.answer_attention` one answer at a time, in PyTorch: the contract the Triton kernel meets on the GPU."""
    S, Hq, D = q.shape
    B, Hkv, T, _ = k.shape
    out = q.new_zeros(S, Hq * D)
    for b in range(B):
        slot, start = int(slots[b]), int(starts[b])
        n = int(key_lengths[slot])
        keys = torch.cat([bank_k[slot, :, :n], k[b]], 1).repeat_interleave(Hq // Hkv, 0)     # [Hq, n + T, D]
        values = torch.cat([bank_v[slot, :, :n], v[b]], 1).repeat_interleave(Hq // Hkv, 0)
        for s in range(start, start + int(counts[b])):
            seen = n + int(rows[s]) - b * T + 1
            scores = (q[s][:, None, :] @ keys[:, :seen].transpose(-1, -2)) * scale             # [Hq, 1, seen]
            o = torch.softmax(scores, -1) @ values[:, :seen]
            out[s] = (o[:, 0] * torch.sigmoid(gate[s])).reshape(-1)
    return out


def test_last_layer_queries_at_the_answers_alone_score_a_mixed_batch_as_every_query(tiny_dir, monkeypatch):
    """`engine.model.ANSWER_QUERIES` through the engine: rows of several schemas with different answer counts (each
    row's answers located by the step's starts and counts), both prefix modes, padding rows; the last layer's
    attention at the answer rows alone gives what attention at every token gives."""
    import dataclasses

    from engine import model

    eng = Engine.load(tiny_dir, device="cpu", dtype="float32")
    calls, scored = [], []
    eng.forward.kernels = dataclasses.replace(
        eng.forward.kernels, answer_attention=lambda *a: calls.append(1) or _answer_attention_by_answer(*a))
    se = SchemaEngine(eng)
    requests = _mixed_requests(se, _schemas(se, 5, seed=6), make_states(13, seed=7), seed=8)
    for on in (False, True):
        monkeypatch.setattr(model, "ANSWER_QUERIES", on)
        scored.append(se.score_mixed(requests))
    assert len(calls) == 1 and _max_diff(*scored) < CPU_ATOL             # one step: 13 states, graphs off on the CPU
