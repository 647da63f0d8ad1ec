"""``decider schema``: publish, delete, list and show the question schemas of the schemas topic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from worker.cli.errors import friendly_errors
from worker.cli.options import BootstrapOpt, SchemasTopicOpt, cluster
from worker.config import Topics
from worker.ops.wording import counted

schema_app = typer.Typer(help="Publish, delete, list and show question schemas.", no_args_is_help=True,
                         rich_markup_mode=None)


def _schema_id(help_text: str):
    """The --id option of the schema commands (``DECIDER_SCHEMA_ID``)."""
    return typer.Option(..., "--id", envvar="DECIDER_SCHEMA_ID", help=help_text)


@schema_app.command("put")
@friendly_errors
def schema_put(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help='Schema file: {"mode": "packed", "questions": [{"id", "question", "options", "temperature"?}, ...]}.'),
    schema_id: str = _schema_id("Schema id (the record key)."),
    version: Optional[int] = typer.Option(None, "--version", help="Explicit version; default: the latest published version + 1."),
    bootstrap: str = BootstrapOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """Publish a question schema as a new version of ID; a file equal to the latest version publishes nothing."""
    from worker.cli.commands import put_schema

    record, published = put_schema(cluster(ctx, bootstrap), Topics(schemas=schemas_topic), schema_id, file, version)
    if published:
        typer.echo(f"schema {schema_id} version {record['version']} published ({counted(len(record['questions']), 'question')})")
    else:
        typer.echo(f"schema {schema_id} unchanged, version {record['version']} (the same content; nothing published)")


@schema_app.command("delete")
@friendly_errors
def schema_delete(
    ctx: typer.Context,
    schema_id: str = _schema_id("Schema id to delete."),
    bootstrap: str = BootstrapOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """Delete a schema (tombstone); later states naming it go to the dead-letter topic.

    Exit code 2 when the schemas topic does not hold ID (never published, a typo, or deleted already): nothing is
    deleted."""
    from worker.cli.commands import delete_schema

    version = delete_schema(cluster(ctx, bootstrap), Topics(schemas=schemas_topic), schema_id)
    typer.echo(f"schema {schema_id} deleted (its latest version was {version})")


@schema_app.command("list")
@friendly_errors
def schema_list(
    ctx: typer.Context,
    bootstrap: str = BootstrapOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """List the schemas the topic holds: id, latest version, questions, mode (one line each)."""
    from worker.cli.commands import published_schemas

    held, deleted = published_schemas(cluster(ctx, bootstrap), Topics(schemas=schemas_topic))
    width = max(map(len, held), default=0)
    for schema_id, record in held.items():
        problem = getattr(record, "problem", None)
        shown = (f"unusable: {problem}" if problem else
                 f"version {record['version']}  {counted(len(record['questions']), 'question')}  {record['mode']}")
        typer.echo(f"{schema_id:<{width}}  {shown}")
    if not held:
        typer.echo(f"no schema in {schemas_topic}; publish one with: decider schema put --id ID FILE", err=True)
    if deleted:
        typer.echo(f"deleted: {', '.join(sorted(deleted))}", err=True)


@schema_app.command("get")
@friendly_errors
def schema_get(
    ctx: typer.Context,
    schema_id: str = _schema_id("Schema id to show."),
    bootstrap: str = BootstrapOpt,
    schemas_topic: str = SchemasTopicOpt,
) -> None:
    """Print the latest version of a schema as a schema file (JSON), which decider schema put takes back.

    Exit code 2 when the schemas topic does not hold ID."""
    from worker.cli.commands import require_schema
    from worker.exceptions import ConfigError
    from worker.formats.records import schema_document

    record = require_schema(cluster(ctx, bootstrap), Topics(schemas=schemas_topic), schema_id,
                            "decider schema list shows the schemas")
    if getattr(record, "problem", None):
        raise ConfigError(f"schema {schema_id!r} is unusable: {record.problem}")
    typer.echo(json.dumps(schema_document(record), indent=2, ensure_ascii=False))
