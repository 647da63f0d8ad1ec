"""The label mass (`engine.label_mass`): the share of the full-vocabulary softmax on a question's labels at its answer
slot. The cached path against the oracle's full softmax, the chunked log-sum-exp against torch's (a table's one-kernel
log-sum-exp taken instead where it has one), bit-identical in any batch with the deterministic kernels, and switchable
per engine and per schema without touching the probabilities."""
import pytest
import torch

from engine import Engine, SchemaEngine
from engine.kernels import cpu_deterministic as inv
from engine import label_mass as lm
from engine.label_mass import FullVocabulary
from engine.reference import score_full_details
from engine.kernels.pytorch import torch_row_logsumexp

from .conftest import make_questions, make_states
from .test_batch_invariance import scored_in_batches

OPTIONS = [2, 3, 5, 8]


@pytest.fixture(scope="module")
def det_se(tiny_dir):
    return SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True))


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_label_mass_equals_the_oracles_full_softmax(se, det_se, eng, deterministic, independent):
    engine_ = det_se if deterministic else se
    qs = make_questions(OPTIONS, temperatures=[0.5, 1.0, 2.0, 0.7])        # the mass is at temperature 1 whatever T
    states = make_states(9, seed=17)
    h = engine_.prepare(qs, independent=independent)
    got = torch.stack([s.label_mass for s in engine_.score_details(h, states)])
    want = torch.stack([s.label_mass for s in score_full_details(eng, qs, states, independent=independent)])
    assert got.shape == (9, len(OPTIONS))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert ((got > 0) & (got <= 1)).all()
    assert got.std() > 0.1 * got.mean(), "the mass must vary with state and question, or the comparison shows little"


def test_the_vocabulary_in_chunks_gives_torchs_logsumexp(eng):
    """Chunks narrower than the vocabulary, the last one zero-padded: the padding is skipped, not counted as logits 0."""
    x = eng.forward.final_norm(torch.randn(11, eng.cfg.hidden_size, generator=torch.Generator().manual_seed(0)))
    weight = eng.model.lm_head.weight.detach()
    want = torch.logsumexp(x @ weight.t(), -1)
    V = weight.shape[0]
    for chunk in (V, 64, 97):
        vocab = FullVocabulary(weight, chunk)
        assert vocab.chunk_weight.shape == (min(chunk, V), weight.shape[1]) and sum(vocab.valid) == V
        for row_lse in (torch_row_logsumexp, inv.row_logsumexp):
            torch.testing.assert_close(vocab.logsumexp(x, torch.nn.functional.linear, row_lse), want,
                                       rtol=1e-6, atol=1e-5)


def test_a_tables_fused_logsumexp_takes_the_whole_weight_unless_switched_off(eng, det_se, monkeypatch):
    """`Kernels.vocab_logsumexp` (CUDA's one-kernel log-sum-exp: tests/engine/kernels/test_vocab_logsumexp.py) gets the
    unpadded weight and its row count; with `FUSED` off, or on the CPU's tables (which have none), the chunks run."""
    weight = eng.model.lm_head.weight.detach()
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(1))
    vocab = FullVocabulary(weight, 97)
    calls = []

    def fused(rows, w, n_valid):
        calls.append((rows, w, n_valid))
        return torch.logsumexp(rows @ w[:n_valid].t(), -1)

    want = torch.logsumexp(x @ weight.t(), -1)
    got = vocab.logsumexp(x, torch.nn.functional.linear, torch_row_logsumexp, fused)
    assert len(calls) == 1 and calls[0][1] is weight and calls[0][2] == weight.shape[0] and torch.equal(got, want)
    monkeypatch.setattr(lm, "FUSED", False)
    torch.testing.assert_close(vocab.logsumexp(x, torch.nn.functional.linear, torch_row_logsumexp, fused), want,
                               rtol=1e-6, atol=1e-5)
    assert len(calls) == 1
    assert eng.forward.kernels.vocab_logsumexp is None and det_se.e.forward.kernels.vocab_logsumexp is None


def test_the_invariant_row_logsumexp_gives_a_row_its_bits_alone_and_in_any_batch():
    """A lone row is summed by PyTorch in two passes across threads, several rows each in one: the invariant kernel
    always gives the reduction at least two rows."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 40_000, generator=g) * 5
    alone = torch.cat([inv.row_logsumexp(rows[i:i + 1], 39_000) for i in range(40)])
    for batch in (2, 3, 17, 40):
        assert torch.equal(torch.cat([inv.row_logsumexp(rows[s:s + batch], 39_000) for s in range(0, 40, batch)]),
                           alone), f"batches of {batch}"
    torch.testing.assert_close(alone, torch_row_logsumexp(rows, 39_000))


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_a_states_label_mass_is_the_same_bits_in_any_batch(det_se, independent):
    states = make_states(12, seed=29, max_words=30)
    h = det_se.prepare(make_questions(OPTIONS), independent=independent)
    alone = [det_se.score_details(h, [s])[0].label_mass for s in states]
    mass_only = _MassOnly(det_se)
    for batch in (5, 12):
        got = scored_in_batches(mass_only, h, states, batch, seed=batch)
        assert all(torch.equal(g, a) for g, a in zip(got, alone)), f"batches of {batch}"


class _MassOnly:
    """`score` giving each state's label mass, so `scored_in_batches` shuffles and batches it."""

    def __init__(self, se):
        self.se = se

    def score(self, h, states):
        return [s.label_mass for s in self.se.score_details(h, states)]


def test_label_mass_switches_per_engine_and_per_schema_without_changing_probabilities(eng):
    qs = make_questions([2, 4])
    states = make_states(6, seed=31)
    off = SchemaEngine(eng, label_mass=False)
    plain, wanted = off.prepare(qs), off.prepare(qs, label_mass=True)
    assert not plain.label_mass and wanted.label_mass
    rows = [off.tokenize(plain, s) for s in states]
    # one batch mixing a schema without the mass and one with it: the step computes it, only `wanted` reports it
    mixed = off.launch_mixed([(plain, r) for r in rows] + [(wanted, r) for r in rows]).details()
    assert all(s.label_mass is None for s in mixed[:6]) and all(len(s.label_mass) == 2 for s in mixed[6:])
    alone = off.launch_mixed([(plain, r) for r in rows]).details()              # a step without the mass at all
    assert [s.probabilities for s in alone] == [s.probabilities for s in mixed[:6]] == \
        [s.probabilities for s in mixed[6:]]
    on = SchemaEngine(eng)
    assert on.label_mass and on.prepare(qs).label_mass and not on.prepare(qs, label_mass=False).label_mass
    assert torch.isnan(off.score_details(plain, states[:1])[0].label_mass).all()
