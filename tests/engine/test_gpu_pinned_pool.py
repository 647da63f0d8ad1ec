"""The staging buffers' pool on a CUDA device (pytest -m gpu): launches in flight back to back, their staging buffers
reused as soon as each launch's done event has passed, give every state the probabilities and label mass that
launches without the pool give, bit for bit, in graphs and eager, while the pool hands buffers out again."""
import pytest
import torch

import engine.pinned_pool as pinned_pool
from engine import Engine, SchemaEngine
from engine.testing import write_tiny_model

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tests.engine.conftest import make_questions, make_states  # noqa: E402


@pytest.mark.parametrize("graphs", [True, False])
def test_pooled_staging_gives_every_launch_its_own_bits(tmp_path, monkeypatch, graphs):
    eng = Engine.load(write_tiny_model(tmp_path / "m"), device="cuda", dtype="bfloat16", deterministic=True)
    se = SchemaEngine(eng, use_graphs=graphs)
    h = se.prepare(make_questions([4, 3, 2]))
    batches = [[(h, row) for row in se.tokenize_many(h, make_states(n, seed=n))] for n in (1, 3, 1, 5, 2, 1) * 4]

    def launched_all() -> list:
        pending = [se.launch_mixed(batch) for batch in batches]      # every launch queued before any is read
        return [(s.probabilities, s.label_mass) for p in pending for s in p.details()]

    want = launched_all()
    monkeypatch.setattr(pinned_pool, "STAGING_POOL", True)
    made = []
    allocate = se._staging._allocate
    monkeypatch.setattr(se._staging, "_allocate", lambda n, d: made.append(n) or allocate(n, d))
    got = launched_all()
    assert got == want
    assert len(made) < len(batches)                                    # the pool handed buffers out again
