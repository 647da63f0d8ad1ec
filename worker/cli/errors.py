"""How the ``decider`` commands end on a mistake a user can fix: one ``error: ...`` line on stderr (secrets of the
config file redacted) and an exit code, never a traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Mapping

import typer
from confluent_kafka import KafkaException

from worker.cli.options import kafka_settings, registry_settings
from worker.exceptions import DeciderError, FatalError


def friendly_errors(command: Callable) -> Callable:
    """Turn the worker's named errors and Kafka errors into one line on stderr (secrets redacted) and an exit code."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        settings = _secrets(kwargs.get("ctx"))
        try:
            return command(*args, **kwargs)
        except FatalError as exc:
            if not exc.reported:
                typer.echo(_redacted(f"error: {exc}", settings), err=True)
            raise typer.Exit(exc.exit_code) from None
        except BrokenPipeError:  # stdout's reader went away (`decider score ... | head -1`)
            _quiet_stdout()
            raise typer.Exit(0) from None
        except DeciderError as exc:
            typer.echo(_redacted(f"error: {exc}", settings), err=True)
            raise typer.Exit(1) from None
        except KafkaException as exc:
            typer.echo(_redacted(f"error: Kafka: {exc.args[0].str() if exc.args else exc}", settings), err=True)
            raise typer.Exit(4) from None

    return wrapper


def _quiet_stdout() -> None:
    """Exit quietly once stdout's reader is gone, as Unix tools do (``head`` has what it wanted): stdout is pointed at
    /dev/null, so that the interpreter's last flush of what is still buffered does not fail with a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (captured in a test): nothing to flush there
        pass


def _secrets(ctx: typer.Context | None) -> dict[str, Any]:
    """Settings whose secrets must not show in an error: the config file's [kafka] and [schema_registry] tables."""
    from worker.formats.registry import secret_settings

    return {**kafka_settings(ctx), **secret_settings(None, registry_settings(ctx))}


def _redacted(text: str, settings: Mapping[str, Any]) -> str:
    """``text`` without any secret of the config file's [kafka] table."""
    from worker.config_file import redact_text

    return redact_text(text, settings)
