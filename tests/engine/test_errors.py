"""Bad input gets a ValueError that names the problem, never a tensor error."""
import json
import shutil

import pytest

from engine import Engine, MAX_OPTIONS
from engine.prompt import MAX_OPTION_CHARS, MAX_PREFIX_TOKENS, MAX_QUESTION_CHARS, MAX_QUESTIONS

from .conftest import make_questions

GOOD = {"question": "Is it bad?", "options": ["yes", "no"]}


@pytest.mark.parametrize("questions, message", [
    ([], "no questions"),
    ("Is it bad?", "expected a list"),
    ([{"question": "", "options": ["a", "b"]}], "non-empty string"),
    ([{"question": "   ", "options": ["a", "b"]}], "non-empty string"),
    ([{"options": ["a", "b"]}], "non-empty string"),
    ([{"question": "Q?", "options": ["a"]}], "has 1 options"),
    ([{"question": "Q?", "options": [str(i) for i in range(MAX_OPTIONS + 1)]}], f"has {MAX_OPTIONS + 1} options"),
    ([{"question": "Q?", "options": ["a", "b", "a"]}], "duplicate options ['a']"),
    ([GOOD] * (MAX_QUESTIONS + 1), f"has {MAX_QUESTIONS + 1} questions; at most {MAX_QUESTIONS} are allowed"),
    ([{"question": "Q?", "options": ["a", ""]}], "non-empty string"),
    ([{"question": "Q?", "options": "ab"}], "must be a list"),
    ([GOOD, {"question": "Q?", "options": ["a", "b"], "temperature": 0}], "question 2"),
    ([{"question": "Q?", "options": ["a", "b"], "temperature": -1.0}], "positive"),
    ([GOOD, "not a dict"], "question 2"),
    ([{"question": "Q" * (MAX_QUESTION_CHARS + 1), "options": ["a", "b"]}], f"at most {MAX_QUESTION_CHARS} are allowed"),
    ([{"question": "Q?", "options": ["a", "b" * (MAX_OPTION_CHARS + 1)]}], f"at most {MAX_OPTION_CHARS} are allowed"),
    ([{"question": "Q? " * (MAX_QUESTION_CHARS // 3), "options": ["a", "b"]}] * (MAX_PREFIX_TOKENS // 500),
     f"tokens; at most {MAX_PREFIX_TOKENS} are allowed"),
])
def test_bad_questions(se, questions, message):
    with pytest.raises(ValueError, match=None) as err:
        se.prepare(questions)
    assert message in str(err.value)


@pytest.mark.parametrize("states, temperature, message", [
    ([], None, "empty batch"),
    ("a single string", None, "list of strings"),
    (["ok", 42], None, "must be a string"),
    (["ok", b"bytes"], None, "must be a string"),
    (["ok"], [1.0], "1 values for a schema with 2 questions"),
    (["ok"], [1.0, 2.0, 3.0], "3 values"),
    (["ok"], 0.0, "positive"),
    (["ok"], -2, "positive"),
    (["ok"], float("nan"), "positive"),
    (["ok"], [1.0, 0.0], "temperature 2"),
    (["ok"], "hot", "positive"),
])
def test_bad_requests(se, states, temperature, message):
    h = se.prepare(make_questions([2, 3]))
    with pytest.raises(ValueError) as err:
        se.score(h, states, temperature=temperature)
    assert message in str(err.value)


def test_bad_model_directories(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Engine.load(tmp_path / "nope")
    cases = {
        "config.json": "missing config.json",
        "model.safetensors": "no \\*.safetensors",
        "tokenizer.json": "no tokenizer",
    }
    for missing, message in cases.items():
        d = tmp_path / f"without-{missing}"
        shutil.copytree(tiny_dir, d)
        (d / missing).unlink()
        if missing == "tokenizer.json":
            (d / "tokenizer_config.json").unlink()
        with pytest.raises(ValueError, match=message):
            Engine.load(d)
    d = tmp_path / "llama"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Engine.load(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Engine.load(d)


def test_bad_device_and_dtype(tiny_dir):
    with pytest.raises(ValueError, match="device 'tpu'"):
        Engine.load(tiny_dir, device="tpu")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        Engine.load(tiny_dir, dtype="int8")
