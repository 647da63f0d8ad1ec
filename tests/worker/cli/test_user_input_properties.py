"""Property tests: whatever a user's file holds (random bytes, random JSON, near-misses of the right shape), the
commands that read it (``produce``, ``schema put``, ``score`` and the ``--config`` file) either accept it, and what
they accept can be published, or refuse it with one ``ConfigError`` line (exit code 2). Never another exception.

The readers are called in this process (the commands call exactly these before touching a broker or a model), with
few examples and no deadline, so the file runs in seconds."""

from __future__ import annotations

import json
import math
import tempfile
import tomllib
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import schemas
from worker.cli.app import app
from worker.exceptions import ConfigError
from worker.cli.offline import score_file
from worker.formats.records import engine_questions, question_schema_record
from worker.config_file import load_config_file
from worker.cli.user_files import MAX_OPTION_CHARS, MAX_QUESTION_CHARS, load_schema_file, read_state_lines

BOUNDED = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
# Unpaired surrogates (which only JSON's \u escapes can carry into a file) and characters JSON strings may hold raw
# but str.splitlines() would cut a line at.
tricky_text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=12) | st.sampled_from(
    ["\ud800", "a\udfffb", "\u2028", "\x85", "\x00", "\ufeff", "", " "])


def _json_text(value) -> str:
    return json.dumps(value)  # writes NaN/Infinity and lone surrogates as JSON does (\ud800 escapes)


event_times = st.sampled_from(["2026-01-01T00:00:00Z", "2026-01-01T01:00:00+01:00", "yesterday", [1], 1e30, 0, -1,
                                True, 1.5, "1700000000000", None]) | json_values


def state_like_objects():
    """Objects close to a state line: string id and state mostly, the optional keys with any values, and
    sometimes a stray key."""
    optional = st.fixed_dictionaries({}, optional={
        "metadata": st.dictionaries(tricky_text, json_values | tricky_text, max_size=3) | json_values,
        "event_time": event_times,
    })
    words = st.text(max_size=12)
    required = st.fixed_dictionaries({"id": st.one_of(words, words, tricky_text, json_values),
                                      "state": st.one_of(words, words, tricky_text, json_values)})
    stray = st.fixed_dictionaries({}, optional={"evnet_time": st.just(0)})
    return st.tuples(required, optional, stray).map(lambda parts: {**parts[0], **parts[1], **parts[2]})


def schema_like_objects():
    """Objects close to a schema file: questions with the right keys, mostly of the right types (so that some are
    accepted and go on to Avro and the engine's own checks), sometimes a stray key or a text over the limits."""
    words = st.text(min_size=1, max_size=10)
    long_text = st.sampled_from(["x" * 2001, "y" * 501, "z" * 1999])
    question = st.fixed_dictionaries(
        {"id": st.one_of(words, words, tricky_text, json_values),
         "question": st.one_of(words, words, words, tricky_text, long_text, json_values),
         "options": st.one_of(*[st.lists(words, min_size=2, max_size=26, unique=True)] * 3,
                              st.lists(st.one_of(tricky_text, long_text), max_size=27), json_values)},
        optional={"temperature": st.sampled_from([0.5, 1, 2.0, 0, -1, float("nan"), True, "hot"])},
    )
    misspelt = st.fixed_dictionaries({"id": st.just("q"), "question": st.just("Q?"), "optoins": st.just(["a", "b"])})
    questions = st.lists(st.one_of(*[question] * 6, misspelt), min_size=1, max_size=3)
    return st.fixed_dictionaries({"questions": st.one_of(questions, questions, questions, json_values)},
                                 optional={"mode": st.sampled_from(["packed", "independent", "both", None, 1])})


def _sized(seed: str, length: int) -> str:
    """A text of exactly ``length`` characters that starts with a letter (never blank), repeating ``seed``."""
    return ("Q" + seed * length)[:length]


@st.composite
def near_limit_schemas(draw):
    """Schema files of the right shape and valid but for at most one defect (two in five): texts at the limits
    (MAX_QUESTION_CHARS, MAX_OPTION_CHARS, 2 and 26 options, and at times over MAX_SCHEMA_CHARS in all), or one past a
    limit, a lone surrogate, a blank option, a bad temperature. Most are accepted, so the half that checks what is
    accepted (Avro and the engine accept it too) runs on most examples, and a limit moved or a check removed lets a
    defect through to it."""
    seed = draw(st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=4))  # astral characters included
    questions = []
    for index in range(draw(st.integers(1, 6))):
        count = draw(st.sampled_from([2, 2, 3, 4, 5, 8, 26]))
        question = {"id": f"q{index}", "question": _sized(seed, draw(st.sampled_from([1, 40, MAX_QUESTION_CHARS - 1, MAX_QUESTION_CHARS]))),
                    "options": [f"{n}" + _sized(seed, draw(st.sampled_from([2, 12, 12, MAX_OPTION_CHARS - 1, MAX_OPTION_CHARS])) - len(f"{n}"))
                                for n in range(count)]}
        if draw(st.booleans()):
            question["temperature"] = draw(st.sampled_from([0.5, 1, 2.0, 0.05]))
        questions.append(question)
    first, last = questions[0], questions[-1]
    defect = draw(st.sampled_from([None] * 18 + list(_DEFECTS)))
    if defect is not None:
        _DEFECTS[defect](first, last)
    return {"mode": draw(st.sampled_from(["packed", "independent"])), "questions": questions}


_DEFECTS = {  # name: how it spoils the first or the last question of a valid schema
    "question over the limit": lambda first, last: last.update(question=_sized("x", MAX_QUESTION_CHARS + 1)),
    "question far over the limit": lambda first, last: last.update(question=_sized("x", 2500)),
    "option over the limit": lambda first, last: first["options"].__setitem__(0, _sized("o", MAX_OPTION_CHARS + 1)),
    "one option": lambda first, last: first.update(options=first["options"][:1]),
    "27 options": lambda first, last: first.update(options=[f"option {n}" for n in range(27)]),
    "zero temperature": lambda first, last: first.update(temperature=0),
    "boolean temperature": lambda first, last: first.update(temperature=True),
    "NaN temperature": lambda first, last: first.update(temperature=float("nan")),
    "surrogate in an id": lambda first, last: first.update(id=first["id"] + "\ud800"),
    "surrogate in a question": lambda first, last: last.update(question=last["question"][:-1] + "\udfff"),
    "half an astral pair in an option": lambda first, last: first["options"].__setitem__(-1, "\ud83d" + first["options"][-1][1:]),
    "blank option": lambda first, last: first["options"].__setitem__(0, " "),
}


def _schema(*questions: tuple[int, list[int]], **question_keys) -> dict:
    """A schema file of questions of these (question length, [option lengths])."""
    return {"questions": [{"id": f"q{i}", "question": _sized("ab", length), **question_keys,
                           "options": [f"{n}" + _sized("cd", size - len(f"{n}")) for n, size in enumerate(sizes)]}
                          for i, (length, sizes) in enumerate(questions)]}


# Each limit exactly met (accepted), and exceeded by one (refused); a lone surrogate wherever text goes.
_AT_THE_LIMITS = [
    _schema((MAX_QUESTION_CHARS, [MAX_OPTION_CHARS] * 26)),
    _schema((1, [2] * 27)),                                                      # one option too many
    _schema(*[(1, [1, 1])] * 64),                                                # 64 questions: accepted
    _schema(*[(1, [1, 1])] * 65),                                                # one question too many
    _schema((MAX_QUESTION_CHARS + 1, [1, 1])),
    _schema((1, [MAX_OPTION_CHARS + 1, 1])),
    _schema(*[(2000, [500, 500, 500, 500, 500, 500])] * 6, (1000, [500, 500])),  # 32,000 characters exactly
    _schema(*[(2000, [500, 500, 500, 500, 500, 500])] * 6, (1001, [500, 500])),  # one over
    {"questions": [{"id": "q\ud800", "question": "Q?", "options": ["a", "b"]}]},
    {"questions": [{"id": "q", "question": "Q \udfff?", "options": ["a", "b"]}]},
    {"questions": [{"id": "q", "question": "Q?", "options": ["a", "b\ud83d"]}]},
    {"questions": [{"id": "q", "question": "Q?", "options": ["a", " "]}]},
    {"questions": [{"id": "q", "question": "Q?", "options": ["a", "b"], "temperature": True}]},
]


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="decider-properties-") as directory:
        yield Path(directory)


def _assert_one_line(error: ConfigError) -> None:
    assert error.exit_code == 2 and str(error) and "\n" not in str(error), repr(str(error))


def _check_states_file(path: Path) -> None:
    try:
        records = read_state_lines(path, "s")
    except ConfigError as error:
        _assert_one_line(error)
        return
    for record in records:  # what produce would publish: the key and the Avro value must encode
        record["state_id"].encode("utf-8")
        assert schemas.decode_state(schemas.encode_state(record))["state"] == record["state"]


def _check_schema_file(path: Path) -> None:
    try:
        document = load_schema_file(path)
    except ConfigError as error:
        _assert_one_line(error)
        return
    record = question_schema_record(document, "s", 1)
    assert schemas.decode_question_schema(schemas.encode_question_schema(record))["questions"] == record["questions"]
    from engine.prompt import parse_questions

    parse_questions(engine_questions(record))  # what schema put accepts, the engine accepts (as the worker hands it over)


# ---- produce ----------------------------------------------------------------------------------------------------------
@BOUNDED
@given(data=st.binary(max_size=300))
def test_states_file_of_random_bytes(scratch, data):
    (scratch / "states.jsonl").write_bytes(data)
    _check_states_file(scratch / "states.jsonl")


@BOUNDED
@given(lines=st.lists(st.one_of(state_like_objects(), state_like_objects(), state_like_objects(), json_values), min_size=1, max_size=3))
def test_states_file_of_random_json_lines(scratch, lines):
    (scratch / "states.jsonl").write_text("\n".join(_json_text(line) for line in lines), encoding="utf-8")
    _check_states_file(scratch / "states.jsonl")


# A lone surrogate (or half of an astral pair) in each place a states line holds text: every one must be refused.
_SURROGATE_LINES = [
    {"id": "s\ud800", "state": "text"},
    {"id": "s", "state": "text \udfff"},
    {"id": "s", "state": "\ud83d half a pair"},
    {"id": "s", "state": "text", "metadata": {"key": "value \ud800"}},
    {"id": "s", "state": "text", "metadata": {"key \udfff": "value"}},
    {"id": "s", "state": "text", "metadata": {"nested": ["\ud800"]}},  # a non-string value is kept as its JSON text
]
for _line in _SURROGATE_LINES:
    test_states_file_of_random_json_lines = example(lines=[{"id": "ok", "state": "fine"}, _line])(
        test_states_file_of_random_json_lines)


# ---- schema put ---------------------------------------------------------------------------------------------------
@BOUNDED
@given(data=st.binary(max_size=300))
def test_schema_file_of_random_bytes(scratch, data):
    (scratch / "schema.json").write_bytes(data)
    _check_schema_file(scratch / "schema.json")


@BOUNDED
@given(document=st.one_of(near_limit_schemas(), near_limit_schemas(), near_limit_schemas(), schema_like_objects(), json_values))
def test_schema_file_of_random_json(scratch, document):
    (scratch / "schema.json").write_text(_json_text(document), encoding="utf-8")
    _check_schema_file(scratch / "schema.json")


for _document in _AT_THE_LIMITS:
    test_schema_file_of_random_json = example(document=_document)(test_schema_file_of_random_json)


def test_the_examples_at_the_limits_are_accepted_or_refused_as_meant(scratch):
    """The @examples above do test both halves: those within the limits are accepted, the others refused."""
    outcomes = []
    for document in _AT_THE_LIMITS:
        (scratch / "limits.json").write_text(_json_text(document), encoding="utf-8")
        try:
            load_schema_file(scratch / "limits.json")
            outcomes.append("accepted")
        except ConfigError:
            outcomes.append("refused")
    assert outcomes == (["accepted", "refused", "accepted", "refused"] + ["refused", "refused", "accepted", "refused"]
                        + ["refused"] * 5)


# ---- score --------------------------------------------------------------------------------------------------------
@BOUNDED
@given(schema_data=st.binary(max_size=120) | near_limit_schemas().map(lambda d: _json_text(d).encode())
       | schema_like_objects().map(lambda d: _json_text(d).encode()),
       states_data=st.binary(max_size=120) | st.lists(state_like_objects(), max_size=3).map(
           lambda lines: "\n".join(map(_json_text, lines)).encode()))
def test_score_files_of_random_content(scratch, schema_data, states_data):
    (scratch / "schema.json").write_bytes(schema_data)
    (scratch / "states.jsonl").write_bytes(states_data)
    # No model there: good files end at the model, with a ConfigError too; nothing else may escape.
    with pytest.raises(ConfigError) as refused:
        score_file(str(scratch / "no-model"), scratch / "schema.json", scratch / "states.jsonl")
    _assert_one_line(refused.value)
    if str(refused.value).startswith("--model "):  # both files were accepted: what score accepts, the engine accepts
        _check_schema_file(scratch / "schema.json")
        _check_states_file(scratch / "states.jsonl")


for _document in _AT_THE_LIMITS:
    test_score_files_of_random_content = example(schema_data=_json_text(_document).encode(),
                                                 states_data=b'{"id": "s", "state": "t"}')(test_score_files_of_random_content)


# ---- the config file ----------------------------------------------------------------------------------------------
OPTION_KEYS = ["bootstrap", "states_topic", "max_batch", "max-wait-ms", "metrics_port", "metrics_host", "log_level",
               "partitions", "nope", "model"]
toml_scalars = (st.booleans() | st.integers(min_value=-2**63, max_value=2**63 - 1)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))


def _toml_string(text: str) -> str:
    """A TOML basic string. JSON's escapes are TOML's, but ``json.dumps`` writes a character beyond the Basic
    Multilingual Plane as two \\u escapes of surrogates, which TOML refuses (that made most generated files invalid
    TOML, so the settings in them were never read): write characters as they are, escaping only what TOML must
    have escaped (JSON escapes the other control characters itself)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) and "e" not in repr(value) else "1.5"
    return _toml_string(value) if isinstance(value, str) else json.dumps(value)


def _toml(document: dict) -> str:
    top = [f"{_toml_string(k)} = {_toml_value(v)}" for k, v in document.items() if not isinstance(v, dict)]
    tables = [f"[{_toml_string(k)}]\n" + "\n".join(f"{_toml_string(kk)} = {_toml_value(vv)}" for kk, vv in v.items())
              for k, v in document.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


random_config_documents = st.dictionaries(
    st.sampled_from(OPTION_KEYS + ["worker", "replay", "kafka", "topics"]) | st.text(max_size=6),
    toml_scalars | st.dictionaries(st.sampled_from(OPTION_KEYS + ["security.protocol", "transactional.id"]) | st.text(max_size=6),
                                   toml_scalars, max_size=3),
    max_size=4)
# Settings of the right type for their key (the value itself anything of that type), so that many files are accepted.
_typed_setting = {"bootstrap": st.text(max_size=12), "states_topic": st.text(max_size=12), "max_batch": st.integers(-2, 4096),
                  "max-wait-ms": st.integers(-1, 10**6), "metrics_port": st.integers(-1, 70000),
                  "metrics_host": st.text(max_size=12), "log_level": st.sampled_from(["debug", "info", "loud", "INFO"]),
                  "model": st.text(max_size=12)}
typed_config_documents = st.fixed_dictionaries({}, optional={
    **_typed_setting,
    "worker": st.fixed_dictionaries({}, optional={key: _typed_setting[key] for key in ("max_batch", "max-wait-ms", "model")}),
    "kafka": st.fixed_dictionaries({}, optional={"security.protocol": st.sampled_from(["PLAINTEXT", "SSL", "nonsense"]),
                                                 "client.id": st.text(max_size=12)}),
})
config_documents = st.one_of(typed_config_documents, typed_config_documents, random_config_documents)


def _check_config_file(path: Path) -> None:
    try:
        load_config_file(path, typer.main.get_command(app))
    except ConfigError as error:
        _assert_one_line(error)


@BOUNDED
@given(data=st.binary(max_size=200))
def test_config_file_of_random_bytes(scratch, data):
    (scratch / "decider.toml").write_bytes(data)
    _check_config_file(scratch / "decider.toml")


@BOUNDED
@given(document=config_documents)
def test_config_file_of_random_settings(scratch, document):
    text = _toml(document)
    tomllib.loads(text)  # always valid TOML: what this test tries is the settings (random bytes try the syntax)
    (scratch / "decider.toml").write_text(text, encoding="utf-8")
    _check_config_file(scratch / "decider.toml")
