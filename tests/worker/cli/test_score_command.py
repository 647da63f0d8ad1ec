"""`decider score`: offline scoring of a states file, as a real subprocess, equal to SchemaEngine.score."""
import json
import subprocess
import sys

import pytest

from tests.worker.conftest import expected_probabilities, state_texts

SCHEMA = {"mode": "packed", "questions": [
    {"id": "angry", "question": "Is the customer angry?", "options": ["yes", "no"]},
    {"id": "team", "question": "Which team?", "options": ["billing", "shipping", "support", "sales"], "temperature": 0.5},
]}


def run_score(*args):
    return subprocess.run([sys.executable, "-m", "worker", "score", *args], capture_output=True, text=True, timeout=120)


def test_scores_every_line_like_the_engine(model_dir, schema_engine, tmp_path):
    texts = state_texts(9, seed=21)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "states.jsonl").write_text("".join(json.dumps({"id": f"s-{i}", "state": t}) + "\n" for i, t in enumerate(texts)))
    out = run_score("--model", str(model_dir), "--schema", str(tmp_path / "schema.json"),
                    "--states", str(tmp_path / "states.jsonl"), "--batch-size", "4")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["state_id"] for r in lines] == [f"s-{i}" for i in range(9)]
    want = expected_probabilities(schema_engine, SCHEMA, texts)
    for record, probs in zip(lines, want):
        assert record["schema_id"] == "schema" and record["schema_version"] == 1
        assert [q["id"] for q in record["questions"]] == ["angry", "team"]
        for q, p in zip(record["questions"], probs):
            assert len(q["probabilities"]) == len(q["options"])
            assert max(abs(a - b) for a, b in zip(q["probabilities"], p)) < 1e-5
    assert "scored 9 states" in out.stderr


def test_clear_errors(model_dir, tmp_path):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "states.jsonl").write_text('{"id": "a", "state": "fine"}\nnot json\n')
    bad_model = run_score("--model", str(tmp_path / "missing"), "--schema", str(tmp_path / "schema.json"),
                          "--states", str(tmp_path / "states.jsonl"))
    assert bad_model.returncode != 0 and "line 2 is not JSON" in bad_model.stderr and "Traceback" not in bad_model.stderr
    (tmp_path / "states.jsonl").write_text('{"id": "a", "state": "fine"}\n')
    bad_model = run_score("--model", str(tmp_path / "missing"), "--schema", str(tmp_path / "schema.json"),
                          "--states", str(tmp_path / "states.jsonl"))
    assert bad_model.returncode == 2 and "--model" in bad_model.stderr and "no such directory" in bad_model.stderr
    assert "Traceback" not in bad_model.stderr


def test_a_bad_model_path_fails_before_anything_loads(tmp_path):
    """Checked before torch is imported (seconds), as the worker checks it."""
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "states.jsonl").write_text('{"id": "a", "state": "fine"}\n')
    (tmp_path / "not-a-model").mkdir()
    for model, says in ((tmp_path / "missing", "no such directory"), (tmp_path / "schema.json", "a file, not a directory"),
                        (tmp_path / "not-a-model", "no config.json")):
        probe = ("import atexit, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
                 "from worker.cli.app import main; main(sys.argv[1:])")
        result = subprocess.run([sys.executable, "-c", probe, "score", "--model", str(model), "--schema",
                                 str(tmp_path / "schema.json"), "--states", str(tmp_path / "states.jsonl")],
                                capture_output=True, text=True, timeout=120)
        first, second = result.stderr.splitlines()
        assert result.returncode == 2 and first.startswith(f"error: --model {model}: ") and says in first, result.stderr
        assert second == "torch imported: False"


def test_cuda_on_a_machine_without_it_suggests_cpu(model_dir, tmp_path):
    """The docs' GPU lines say --device cuda:0; without CUDA the one line says what to use instead."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "states.jsonl").write_text('{"id": "a", "state": "fine"}\n')
    result = run_score("--model", str(model_dir), "--schema", str(tmp_path / "schema.json"),
                       "--states", str(tmp_path / "states.jsonl"), "--device", "cuda:0")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: --device cuda:0: CUDA is not available on this machine"), result.stderr
    assert result.stderr.rstrip().endswith("use --device cpu") and result.stderr.count("\n") == 1, result.stderr


def test_a_closed_pipe_ends_the_command_quietly(model_dir, tmp_path):
    """`decider score ... | head -1`: once the reader has gone, exit 0 with nothing on stderr, as Unix tools do (click
    made it exit 1 in silence; a later flush of stdout added "Exception ignored ... BrokenPipeError")."""
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    # far more output than a pipe holds, so the writes after the reader left fail however the processes interleave
    (tmp_path / "states.jsonl").write_text("".join(json.dumps({"id": f"s-{i}", "state": "a state"}) + "\n" for i in range(400)))
    for _ in range(2):
        score = subprocess.Popen([sys.executable, "-m", "worker", "score", "--model", str(model_dir), "--schema",
                                  str(tmp_path / "schema.json"), "--states", str(tmp_path / "states.jsonl")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert json.loads(score.stdout.readline())["state_id"] == "s-0"
        score.stdout.close()  # what head does after its line
        assert score.wait(120) == 0
        assert score.stderr.read() == ""


def test_the_wide_example_with_ordinal_scales_and_26_options_scores_like_the_engine(model_dir, schema_engine, tmp_path):
    """worker/examples/support_schema_wide.json: an ordinal scale "1".."10" (options like any others: labels A..J), one
    "1".."5", and 26 topics (labels A..Z)."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "worker" / "examples" / "support_schema_wide.json"
    schema = json.loads(example.read_text())
    texts = state_texts(3, seed=47)
    (tmp_path / "states.jsonl").write_text("".join(json.dumps({"id": f"w-{i}", "state": t}) + "\n" for i, t in enumerate(texts)))
    out = run_score("--model", str(model_dir), "--schema", str(example), "--states", str(tmp_path / "states.jsonl"))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [[len(q["options"]) for q in r["questions"]] for r in lines] == [[10, 5, 26]] * 3
    assert lines[0]["questions"][0]["options"] == [str(n) for n in range(1, 11)]
    for record, probs in zip(lines, expected_probabilities(schema_engine, schema, texts)):
        for q, p in zip(record["questions"], probs):
            assert len(q["probabilities"]) == len(q["options"]) and abs(sum(q["probabilities"]) - 1) < 1e-5
            assert max(abs(a - b) for a, b in zip(q["probabilities"], p)) < 1e-5
