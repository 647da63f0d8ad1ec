"""Calibration in the engine (`engine.calibration`): option biases from the schema and from its content-free states
(contextual), applied on the device against the oracle, raw probabilities beside the calibrated ones, and PriDe's
position prior from permuted options."""
import hashlib
import math

import numpy as np
import pytest
import torch

from engine import MAX_OPTIONS, Engine, SchemaEngine
from engine.calibration import (CONTENT_FREE_STATES, calibrated, cyclic, fit_order, fit_position_prior)
from engine.errors import InputError
from engine.reference import score_full_details

from .conftest import make_questions, make_states

ATOL = 1e-4


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_contextual_calibration_makes_the_content_free_states_mean_uniform(se, eng, independent):
    """The bias is the log of the content-free states' mean distribution (scored by the engine itself), so that mean,
    calibrated, is uniform; every question is calibrated and reports its raw probabilities."""
    qs = make_questions([2, 3, 5], temperatures=[1.0, 0.5, 2.0])
    h = se.prepare(qs, independent=independent, calibration="contextual")
    plain = se.prepare(qs, independent=independent)
    free = se.score_details(plain, list(CONTENT_FREE_STATES), temperature=1.0)
    assert h.calibrated == (True, True, True)
    for q, n in enumerate(h.n_options):
        mean = np.mean([s.raw_probabilities[q, :n].double().numpy() for s in free], axis=0)
        np.testing.assert_allclose(h.biases[q, :n], np.log(mean), rtol=1e-5)
        assert (h.biases[q, n:] == 0).all()
        uniform = calibrated(mean.tolist(), h.biases[q, :n].tolist(), temperature=qs[q]["temperature"])
        np.testing.assert_allclose(uniform, [1 / n] * n, atol=1e-6)
        assert np.ptp(mean) > 0.05, "a content-free prior this flat would make the test show little"


def _expected_biases(eng, qs: list[dict], calibration: str) -> list[np.ndarray]:
    """The bias each question's logits must lose, worked out here rather than with ``engine.calibration``'s helpers:
    its option_bias as the schema gives it, plus, with contextual calibration, the log of the mean distribution of
    the content-free states (the oracle's forward pass at temperature 1, with no bias)."""
    biases = [np.array(q.get("option_bias") or [0.0] * len(q["options"]), dtype=np.float64) for q in qs]
    if calibration == "contextual":
        plain = [{k: v for k, v in q.items() if k != "option_bias"} for q in qs]
        free = score_full_details(eng, plain, list(CONTENT_FREE_STATES), temperature=1.0)
        for i, q in enumerate(qs):
            n = len(q["options"])
            biases[i] = biases[i] + np.log(np.mean([s.raw_probabilities[i, :n].double().numpy() for s in free], axis=0))
    return biases


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("calibration", ["none", "contextual"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_calibrated_scores_equal_the_oracles(tiny_dir, eng, calibration, deterministic):
    """Calibrated: softmax((z - bias) / T) of the labels' logits z (the oracle's, at temperature 1: log p is z up to a
    constant), with the biases worked out by the test; raw: the oracle's at each question's temperature."""
    qs = make_questions([2, 4, 3], temperatures=[0.5, 1.0, 2.0])
    qs[0]["option_bias"] = [0.7, -0.2]
    qs[2]["option_bias"] = [0.0, 0.0, 0.0]                   # no change: no raw probabilities for it
    engine_ = SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=deterministic))
    states = make_states(7, seed=41)
    h = engine_.prepare(qs, calibration=calibration)
    got = engine_.score_details(h, states)
    biases = _expected_biases(eng, qs, calibration)
    at_one = score_full_details(eng, qs, states, temperature=1.0)
    raw = score_full_details(eng, qs, states)
    for g, one, r in zip(got, at_one, raw):
        for i, q in enumerate(qs):
            n = len(q["options"])
            z = np.log(one.raw_probabilities[i, :n].double().numpy())
            want = _softmax((z - biases[i]) / q["temperature"])
            np.testing.assert_allclose(g.probabilities[i, :n].double().numpy(), want, atol=ATOL)
            assert (g.probabilities[i, n:] == 0).all()
        assert (g.raw_probabilities - r.raw_probabilities).abs().max() < ATOL
    assert h.calibrated == ((True, False, False) if calibration == "none" else (True, True, True))
    details = engine_.launch_mixed([(h, engine_.tokenize(h, s)) for s in states]).details()
    if calibration == "none":
        assert all(d.raw_probabilities[1] is None and d.raw_probabilities[2] is None for d in details)
    assert all(d.raw_probabilities[0] != d.probabilities[0] for d in details)


def test_a_zero_bias_keeps_the_bits_and_a_bias_is_subtracted_before_the_temperature(se):
    qs = make_questions([3, 2], temperatures=[0.5, 1.0])
    states = make_states(5, seed=43)
    plain = torch.stack(se.score(se.prepare(qs), states))
    zero = [{**q, "option_bias": [0.0] * len(q["options"])} for q in qs]
    assert torch.equal(torch.stack(se.score(se.prepare(zero), states)), plain)
    biased = [{**qs[0], "option_bias": [1.0, 0.0, -0.5]}, qs[1]]
    h = se.prepare(biased)
    at_one = se.score_details(se.prepare(qs), states, temperature=1.0)
    for scores, base in zip(se.score_details(h, states), at_one):
        want = calibrated(base.raw_probabilities[0, :3].tolist(), [1.0, 0.0, -0.5], temperature=0.5)
        np.testing.assert_allclose(scores.probabilities[0, :3].numpy(), want, atol=1e-5)
        assert torch.equal(scores.probabilities[1], scores.raw_probabilities[1])


@pytest.mark.parametrize("bad, message", [([0.1], "1 values for 3 options"), ([0.1, float("nan"), 0], "finite"),
                                          ("0.1,0,0", "a list of numbers"), ([True, 0, 0], "finite")])
def test_a_malformed_option_bias_is_refused(se, bad, message):
    q = make_questions([3])
    q[0]["option_bias"] = bad
    with pytest.raises(InputError, match=message):
        se.prepare(q)
    with pytest.raises(InputError, match="calibration must be one of none, contextual"):
        se.prepare(make_questions([3]), calibration="pride")


def test_cyclic_shifts_move_every_option_through_every_position():
    assert cyclic(["a", "b", "c"], 1) == ["c", "a", "b"]
    assert [cyclic(["a", "b", "c", "d"], s).index("a") for s in range(4)] == [0, 1, 2, 3]


def test_the_position_prior_is_the_mean_log_probability_of_a_position_over_shifts():
    """Synthetic scores with a known prior: p(position) ~ prior(position) x merit(option at it)."""
    rnd = np.random.default_rng(0)
    prior = np.log(np.array([0.5, 0.3, 0.2]))
    by_shift = [[] for _ in range(3)]
    for _ in range(20):
        merit = rnd.normal(size=3) * 2
        for shift in range(3):
            logits = prior + np.array([merit[(p - shift) % 3] for p in range(3)])
            p = np.exp(logits) / np.exp(logits).sum()
            by_shift[shift].append([p.tolist()])
    fit = fit_position_prior(by_shift, [3])[0]
    np.testing.assert_allclose(fit.log_prior, prior - prior.mean(), atol=1e-9)
    assert fit.disagreement_before > 0 and fit.disagreement_after == 0 and fit.samples == 20


class PositionBiased:
    """The SchemaEngine with a known log-bias added per option position to every score (then renormalised over the
    question's options): a model whose position prior is its own times exp(bias).

    content_scale > 0 also adds a known preference for options by their text, per state (a log-utility drawn from
    the state's and the option's text, uniform in +-content_scale): the tiny random model's answers follow the prompt,
    not the state or the option's meaning, so with its options reordered its top option is often locked to a position
    whatever the state; a content preference that survives reordering lets the test see the position prior's removal
    bring the orders' answers together."""

    def __init__(self, se, bias: list[float], content_scale: float = 0.0):
        self.se, self.bias, self.content_scale = se, torch.tensor(bias + [0.0] * (MAX_OPTIONS - len(bias))), content_scale

    def prepare(self, *args, **kwargs):
        return self.se.prepare(*args, **kwargs)

    def release(self, h):
        self.se.release(h)

    def score(self, h, states, temperature=None):
        out = []
        for state, p in zip(states, self.se.score(h, states, temperature=temperature)):
            log_bias = self.bias[None, :] + torch.tensor([[self._utility(state, option) for option in q.options]
                                                          + [0.0] * (MAX_OPTIONS - len(q.options)) for q in h.questions])
            biased = p * log_bias.exp()
            out.append(biased / biased.sum(-1, keepdim=True))
        return out

    def _utility(self, state: str, option: str) -> float:
        if not self.content_scale:
            return 0.0
        digest = hashlib.sha256(f"{state}\x00{option}".encode()).digest()
        return (int.from_bytes(digest[:8], "big") / 2**64 * 2 - 1) * self.content_scale


def test_fit_order_recovers_a_known_position_bias(se):
    qs = make_questions([4, 3])
    states = make_states(24, seed=47)
    known = [3.0, 1.0, -1.0, -3.0]
    own = fit_order(se, qs, states)
    fits = fit_order(PositionBiased(se, known), qs, states)
    liked = fit_order(PositionBiased(se, known, content_scale=6.0), qs, states)
    for q, n in enumerate([4, 3]):
        want = np.array(known[:n]) - np.mean(known[:n])
        np.testing.assert_allclose(np.array(fits[q].log_prior) - own[q].log_prior, want, atol=0.05)
        # a preference for options by content cancels over the shifts: the same prior, and the orders now agree more
        np.testing.assert_allclose(liked[q].log_prior, fits[q].log_prior, atol=1e-5)
        assert liked[q].disagreement_after < liked[q].disagreement_before - 0.1, liked[q]
    assert math.isclose(sum(fits[0].log_prior), 0, abs_tol=1e-9)
