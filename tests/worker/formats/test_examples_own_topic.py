"""The "Score your own topic" examples map as the README and docs/own-topics.md say: every ticket line becomes a state; the Debezium
snapshot, create and update become states of the row after the change, and the delete becomes a dead letter."""

from __future__ import annotations

from tests.worker.conftest import REPO
from worker.formats.input_decoder import InputMapper, MappingFailure
from worker.formats.input_mapping import InputMapping
from worker.formats.records import Reason, state_problem
from worker.cli.user_files import load_schema_file

EXAMPLES = REPO / "worker" / "examples"
# The mappings the README's and docs/own-topics.md's commands give on the command line.
TICKETS = InputMapping(format="json", schema_id="support", id_field="ticket.id",
                       text_template="Subject: {ticket.subject}\n\n{ticket.body}", event_time_field="ticket.created_at",
                       metadata_fields=("ticket.priority", "customer.tier"))
DEBEZIUM = InputMapping(format="json", schema_id="support", id_field="after.id",
                        text_template="{after.subject}\n\n{after.body}", event_time_field="source.ts_ms",
                        metadata_fields=("op", "after.status"))


def lines(name: str) -> list[bytes]:
    return [line.encode() for line in (EXAMPLES / name).read_text().splitlines() if line.strip()]


def test_ticket_example_maps_every_line_to_a_scorable_state():
    load_schema_file(EXAMPLES / "support_schema.json")
    states = [InputMapper(TICKETS).map(None, value, None, 1) for value in lines("tickets.jsonl")]
    assert all(isinstance(s, dict) and state_problem(s) is None for s in states), states
    assert states[0]["state"].startswith("Subject: Box arrived crushed\n\nThe order arrived")
    assert states[0]["metadata"] == {"ticket.priority": "high", "customer.tier": "gold"}
    assert states[0]["event_time"] == 1772356320000


def test_debezium_example_scores_changes_and_dead_letters_the_delete():
    results = [InputMapper(DEBEZIUM).map(None, value, None, 1) for value in lines("tickets_debezium.jsonl")]
    scored = [r for r in results if isinstance(r, dict)]
    deleted = [r for r in results if isinstance(r, MappingFailure)]
    assert [s["state_id"] for s in scored] == ["502", "501", "501"]
    assert [s["metadata"]["op"] for s in scored] == ["r", "c", "u"]
    assert "third time" in scored[2]["state"]
    assert len(deleted) == 1 and deleted[0].reason is Reason.INVALID_FIELDS and "delete" in deleted[0].message
