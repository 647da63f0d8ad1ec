"""The prefix state is read-only: scores do not depend on what was scored before or beside a state."""
import torch

from .conftest import make_questions, make_states

STABLE_ATOL = 1e-6   # CPU float32: the same state in another batch differs only by reduction order


def snapshot(se, h) -> list[torch.Tensor]:
    return [t for slot in h.prefix_slots for t in se.bank.snapshot(slot)]


def test_same_states_twice_and_in_other_batches(se):
    qs = make_questions([2, 4, 8])
    states = make_states(12, seed=5)
    for independent in (False, True):
        h = se.prepare(qs, independent=independent)
        before = snapshot(se, h)
        first = torch.stack(se.score(h, states))
        again = torch.stack(se.score(h, states))
        reversed_ = torch.stack(se.score(h, states[::-1])).flip(0)
        alone = torch.stack([se.score(h, [s])[0] for s in states[:4]])
        mixed = torch.stack(se.score(h, states[:4] + make_states(9, seed=99, max_words=120)))[:4]
        assert (first - again).abs().max().item() == 0.0
        assert (first - reversed_).abs().max().item() < STABLE_ATOL
        assert (first[:4] - alone).abs().max().item() < STABLE_ATOL
        assert (first[:4] - mixed).abs().max().item() < STABLE_ATOL
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(se, h))), "scoring wrote to the prefix"


def test_several_schemas_held_at_once(se):
    states = make_states(3, seed=8)
    h1, h2 = se.prepare(make_questions([2, 3])), se.prepare(make_questions([4]), independent=True)
    p1 = torch.stack(se.score(h1, states))
    se.score(h2, states)
    assert torch.equal(p1, torch.stack(se.score(h1, states)))
    assert h1.id != h2.id and h1.nbytes > 0


def test_plain_lists_are_the_tensors_cut_to_each_questions_options(se):
    # the worker publishes score_lists; the oracle comparisons read score_rows: both must be the same numbers
    h = se.prepare(make_questions([2, 4, 3]))
    rows = [se.tokenize(h, s) for s in make_states(5, seed=9)]
    tensors, lists = se.score_rows(h, rows), se.score_lists(h, rows)
    assert len(lists) == len(tensors) == 5
    for table, per_question in zip(tensors, lists):
        assert [len(p) for p in per_question] == [2, 4, 3]
        for q, probs in enumerate(per_question):
            assert probs == table[q, :len(probs)].tolist()
            assert abs(sum(probs) - 1) < 1e-5
