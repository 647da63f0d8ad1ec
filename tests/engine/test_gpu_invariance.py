"""Deterministic scoring on a CUDA device (pytest -m gpu): a state's probabilities are bit-identical whatever its batch.

The 0.8B shape in bf16 with graphs, 10 questions x 4 options: 210 states of 64, 128 and 256 tokens each scored alone,
then in shuffled mixed-length batches of 2, 7, 32, 61 and 128 at random positions among random neighbours (so in
other batch buckets and length buckets), must give `torch.equal` probabilities; so must eager and graph runs, and
independent schemas (prefixes of unequal lengths). The default path is measured beside it and only reported.
"""
import random

import pytest
import torch

from engine import Engine, SchemaEngine

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from bench.workload import QWEN35_08B, questions, states  # noqa: E402

BATCHES = (2, 7, 32, 61, 128)


@pytest.fixture(scope="module")
def model_and_tok():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from engine.testing import build_tokenizer
    tok = build_tokenizer()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**QWEN35_08B, "vocab_size": len(tok)},
                                                     pad_token_id=tok.pad_token_id))
    return model.to(torch.bfloat16).eval(), tok


@pytest.fixture(scope="module")
def engines(model_and_tok):
    model, tok = model_and_tok
    return {det: Engine(model, tok, model_id="0.8b-shaped", deterministic=det) for det in (True, False)}


@pytest.fixture(scope="module")
def texts(model_and_tok):
    tok = model_and_tok[1]
    return [t for n, seed in ((64, 1), (128, 2), (256, 3)) for t in states(tok, 70, n, seed)]


def score_in_batches(se, h, texts: list[str], size: int, seed: int) -> dict[int, torch.Tensor]:
    """Every text scored once, inside shuffled batches of `size` (the last one smaller) -> index -> probabilities."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    out = {}
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        for i, p in zip(chunk, se.score(h, [texts[i] for i in chunk])):
            out[i] = p
    return out


def mismatches(alone: list[torch.Tensor], batched: dict[int, torch.Tensor]) -> tuple[int, float]:
    diffs = [(alone[i] - p).abs().max().item() for i, p in batched.items() if not torch.equal(alone[i], p)]
    return len(diffs), max(diffs, default=0.0)


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_probabilities_do_not_depend_on_the_batch(engines, model_and_tok, texts, independent):
    tok = model_and_tok[1]
    qs = questions(tok, 10, 4, 400)
    subset = texts if not independent else texts[::3]        # independent: 10 rows a state
    report = {}
    for det in (True, False):
        se = SchemaEngine(engines[det])
        h = se.prepare(qs, independent=independent)
        alone = [se.score(h, [t])[0] for t in subset]
        rows = {size: mismatches(alone, score_in_batches(se, h, subset, size, seed=size)) for size in BATCHES}
        report[det] = rows
        print(f"deterministic={det} independent={independent}: "
              + ", ".join(f"batch {s}: {n} differ (max {d:.2e})" for s, (n, d) in rows.items()))
    assert all(n == 0 for n, _ in report[True].values()), report[True]


def test_graphs_and_eager_agree_bit_for_bit(engines, model_and_tok, texts):
    qs = questions(model_and_tok[1], 10, 4, 400)
    graphed, eager = SchemaEngine(engines[True]), SchemaEngine(engines[True], use_graphs=False)
    sample = texts[::7]
    a = graphed.score(graphed.prepare(qs), sample)
    b = eager.score(eager.prepare(qs), sample)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert graphed.graph_stats()["replays"] > 0 and eager.graph_stats()["replays"] == 0


def test_a_fresh_engine_gives_the_same_bits(engines, model_and_tok, texts):
    """What a replay in another process relies on: a second engine on the same weights reproduces the first."""
    model, tok = model_and_tok
    qs = questions(tok, 10, 4, 400)
    first = SchemaEngine(engines[True])
    second = SchemaEngine(Engine(model, tok, model_id="0.8b-shaped", deterministic=True))
    sample = texts[::5]
    a = first.score(first.prepare(qs), sample)
    b = second.score(second.prepare(qs), list(reversed(sample)))[::-1]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


_OTHER_PROCESS = """
import json, sys
import torch
from engine import Engine, SchemaEngine
model_dir, inputs, out = sys.argv[1:]
spec = json.load(open(inputs))
se = SchemaEngine(Engine.load(model_dir, device="cuda", deterministic=True))
torch.save(se.score(se.prepare(spec["questions"]), spec["texts"]), out)
"""


def test_another_process_gives_the_same_bits(engines, model_and_tok, texts, tmp_path):
    """What a replay relies on, across processes: another process loading the same weights prepares the schema and
    scores the states with the same bits. Its fla kernels run the launches `cuda_fast.PINNED_LAUNCHES` pins (fla
    would time its candidates anew in each process, and the block it picks over the key dimension splits sums)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    model, tok = model_and_tok
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    qs = questions(tok, 10, 4, 400)
    sample = texts[::9]
    (tmp_path / "inputs.json").write_text(json.dumps({"questions": qs, "texts": sample}))
    here = SchemaEngine(engines[True])
    mine = here.score(here.prepare(qs), sample)
    run = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(tmp_path / "model"), str(tmp_path / "inputs.json"),
                          str(tmp_path / "theirs.pt")], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "theirs.pt")
    assert len(theirs) == len(mine)
    assert all(torch.equal(a, b.to(a.device)) for a, b in zip(mine, theirs)), \
        max((a - b.to(a.device)).abs().max().item() for a, b in zip(mine, theirs))


def test_each_kernel_family_on_its_own():
    """One test per source of batch dependence found on the H200 (`bench/probes/invariance_probe.py`): a probe's rows
    among random neighbours in batches of 1 x 184 to 128 x 264 rows, compared bit for bit with the probe alone. The
    Triton GEMM, the Triton attention (both halves) and fla's delta rule must be invariant; torch's flash attention is
    reported (it is what deterministic mode replaces)."""
    import random as _random

    from bench.probes import invariance_probe as probe

    rng = _random.Random(0)
    gemms = probe.gemm_invariance(rng)
    assert all(r["all_equal"] for key, r in gemms.items() if key.endswith("/triton")), gemms
    attention = probe.attention_invariance(rng)
    assert attention["prefix/triton"]["all_equal"] and attention["suffix/triton"]["all_equal"], attention
    print("flash attention: prefix max diff", attention["prefix/flash"]["max_abs"], "suffix",
          attention["suffix/flash"]["max_abs"])
    delta, _ = probe.delta_rule_invariance(rng)
    assert delta["all_equal"], delta


def test_many_schemas_in_one_batch_score_as_alone_and_share_graphs(engines, model_and_tok, texts):
    """States of 12 schemas (prefixes of 300 to 520 tokens) in one batch, each row reading its prefix from the bank by
    index: bit-identical to each state scored alone, and the same graphs as one schema's batches of those shapes."""
    tok = model_and_tok[1]
    se = SchemaEngine(engines[True])
    schemas = [se.prepare(questions(tok, 10, 4, 300 + 20 * i, seed=i)) for i in range(12)]
    assert len(set(h.prefix_tokens for h in schemas)) > 1
    sample = texts[::3]                                                   # 70 states, 64 to 256 tokens
    requests = [(schemas[i % len(schemas)], se.tokenize(schemas[i % len(schemas)], t)) for i, t in enumerate(sample)]
    alone = [se.score_lists(h, [row])[0] for h, row in requests]
    before = se.graph_stats()
    mixed = se.score_mixed(requests)
    assert mixed == alone
    one = SchemaEngine(engines[True])
    h = one.prepare(questions(tok, 10, 4, 400))
    one.score_lists(h, [one.tokenize(h, t) for t in sample])
    assert se.graph_stats()["graphs"] - before["graphs"] == one.graph_stats()["graphs"] == 1
    print("bank:", se.memory())


PLACEMENTS = [(2, 184), (8, 192), (12, 184), (32, 184), (40, 256), (64, 184), (128, 184), (128, 264)]
"""Batches (rows, padded length) a probe row of 182 tokens is placed in, as `bench/probes/invariance_probe.py` places
it."""


def test_the_deterministic_attention_kernels_give_a_row_the_same_bits_in_any_batch(engines):
    """The deterministic table's one-kernel suffix attention (at the launches it chose at load) and its answers'
    attention, at the 0.8B shape in bf16: a probe row of 182 tokens after a 400-token prefix, alone (one row: the small
    launch where the table took one) and among random neighbours (other prefixes and lengths, other answer counts) in
    batches of 2 x 184 to 128 x 264 (the large launch), must give the same bits. The fast table's suffix attention,
    which picks its launch by the batch's size, is measured beside it and only reported."""
    from engine.kernels.suffix_attention import answer_attention, suffix_attention

    from .kernels.attention_cases import Case, probe_in_placements

    table = engines[True].forward.kernels
    case = Case((8, 2, 256), (400, 37, 129, 512, 300), 512, torch.bfloat16, "cuda", seed=11)
    answers = list(range(163, 182, 2))                      # 10 answer slots at the end of the row
    kwargs = dict(placements=PLACEMENTS, L=182, slot=0, probe_answers=answers, per_row=16, scale=256 ** -0.5)
    rows = probe_in_placements(case, table.suffix_attention, table.answer_attention, **kwargs)
    fast = probe_in_placements(case, suffix_attention, answer_attention, **kwargs)
    print(f"deterministic table: {table.suffix_attention!r}")
    for name, result in (("deterministic", rows), ("fast", fast)):
        print(f"{name}: " + ", ".join(f"{r['R']}x{r['T']}: suffix {_same(r, 'suffix')}, answers {_same(r, 'answers')}"
                                      for r in result))
    assert all(r["suffix_equal"] and r["answers_equal"] for r in rows), rows


def _same(row: dict, kernel: str) -> str:
    return "same bits" if row[f"{kernel}_equal"] else f"max diff {row[f'{kernel}_max_abs']:.2e}"


def test_the_deterministic_table_runs_one_kernel_attention_and_the_answers_at_every_batch_size(engines, model_and_tok,
                                                                                               texts, monkeypatch):
    """The deterministic table's attention path: the one-kernel suffix attention in every full-attention layer but the
    last, and the answers' attention in the last, in steps of one row as in steps of many (a state alone takes the
    path it takes in a batch); the split path's kernels never."""
    import dataclasses

    from engine.kernels.suffix_attention import InvariantSuffixAttention

    eng = engines[True]
    table = eng.forward.kernels
    assert table.batch_invariant and isinstance(table.suffix_attention, InvariantSuffixAttention)
    assert table.answer_attention is not None and table.add_linear is None
    calls = {"suffix": 0, "answers": 0, "split": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(eng.forward, "kernels", dataclasses.replace(
        table, suffix_attention=counted("suffix", table.suffix_attention),
        answer_attention=counted("answers", table.answer_attention),
        indexed_attention=counted("split", table.indexed_attention), attention=counted("split", table.attention)))
    se = SchemaEngine(eng, use_graphs=False)
    h = se.prepare(questions(model_and_tok[1], 10, 4, 400))
    layers = eng.forward.core.layers
    attention_layers = sum(layer.block_type != "linear_attention" for layer in layers)
    assert layers[-1].block_type != "linear_attention"
    for size in (1, 3):
        calls.update(suffix=0, answers=0)
        se.score(h, texts[:size])
        assert calls == {"suffix": attention_layers - 1, "answers": 1, "split": 0}, (size, calls)


def test_without_a_workspace_every_projection_is_one_cublas_gemm(engines):
    """Importing the engine leaves cuBLAS no workspace (engine.cublas_workspace), so it never splits K, and each
    projection shape is batch-invariant as one GEMM: no blocked down projection, no Triton matmul (run CU)."""
    import os

    from engine import cublas_workspace

    if any(os.environ.get(name) != value for name, value in cublas_workspace.NO_WORKSPACE.items()):
        pytest.skip(f"cuBLAS's workspace chosen outside the engine: {cublas_workspace.describe()}")
    linear = engines[True].forward.kernels.linear
    assert linear.floors and linear.blocked == set() and linear.triton == set(), (linear.blocked, linear.triton)
