"""worker.cli.user_files: event times, and the schema limits the CLI repeats from the engine (so it need not import torch)."""

from __future__ import annotations

import pytest

from worker.cli import user_files
from worker.formats import records
from worker.cli.user_files import event_time_ms


@pytest.mark.parametrize("value, epoch_ms", [
    (0, 0),  # the epoch, not "now"
    (1_700_000_000_000, 1_700_000_000_000),
    (1.7e12, 1_700_000_000_000),
    ("1700000000000", 1_700_000_000_000),
    ("2026-01-01T00:00:00Z", 1_767_225_600_000),
    ("2026-01-01T00:00:00", 1_767_225_600_000),  # no zone: UTC
    ("2026-01-01T01:00:00+01:00", 1_767_225_600_000),
    ("2026-01-01", 1_767_225_600_000),
    ("2026-01-01T00:00:00.123Z", 1_767_225_600_123),
    ("1969-12-31T23:59:59Z", -1000),
])
def test_event_times_users_write(value, epoch_ms):
    assert event_time_ms(value) == epoch_ms


@pytest.mark.parametrize("value", ["yesterday", "", [1], {"t": 1}, True, 1e30, -1e30, 1.5, float("nan"), "2026-02-30"])
def test_what_is_not_an_event_time(value):
    with pytest.raises(ValueError):
        event_time_ms(value)


def test_absent_event_time_is_now():
    import time

    before = int(time.time() * 1000)
    assert before <= event_time_ms(None) <= int(time.time() * 1000)


def test_the_cli_limits_are_the_engines():
    from engine import prompt

    assert user_files.MAX_QUESTION_CHARS == prompt.MAX_QUESTION_CHARS
    assert user_files.MAX_OPTION_CHARS == prompt.MAX_OPTION_CHARS
    assert (records.MAX_OPTIONS, records.MAX_QUESTIONS) == (prompt.MAX_OPTIONS, prompt.MAX_QUESTIONS) == (26, 64)
    # English runs about 4 characters a token: a schema within the character limit fits the token limit.
    assert user_files.MAX_SCHEMA_CHARS <= 4 * prompt.MAX_PREFIX_TOKENS
