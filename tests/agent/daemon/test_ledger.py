"""The daemon's ledger: command records and announcements, written in the caller's outbox
transaction and read back the way the command handler and recovery read them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.daemon.ledger import Ledger, StoredCommand
from agent.mqtt.outbox import Outbox


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(Outbox(tmp_path))


def test_a_command_record_is_kept_once_and_read_back(ledger: Ledger) -> None:
    assert ledger.stored_command("c-1") is None
    with ledger.outbox.tx() as tx:
        ledger.record_command(tx, "c-1", "ping", "SUCCEEDED", {"pong": True}, None)
        ledger.record_command(tx, "c-1", "ping", "FAILED", None, {"code": "INTERNAL"})
    assert ledger.stored_command("c-1") == StoredCommand("SUCCEEDED", {"pong": True}, None)
    with ledger.outbox.tx() as tx:
        ledger.record_command(tx, "c-2", "cancel", "REJECTED", None, {"code": "NOT_FOUND"})
    assert ledger.stored_command("c-2") == StoredCommand("REJECTED", None,
                                                         {"code": "NOT_FOUND"})


def test_announcements_read_inside_and_outside_the_transaction(ledger: Ledger) -> None:
    with ledger.outbox.tx() as tx:
        ledger.mark_announced(tx, "j-1", "ACCEPTED")
        ledger.mark_announced(tx, "j-1", "ACCEPTED")
        assert ledger.announced("j-1", tx) == {"ACCEPTED"}
        ledger.mark_announced(tx, "j-1", "SUCCEEDED")
    assert ledger.announced("j-1") == {"ACCEPTED", "SUCCEEDED"}
    assert ledger.announced("j-2") == set()


def test_a_record_commits_or_rolls_back_with_its_outbox_row(ledger: Ledger) -> None:
    with pytest.raises(RuntimeError), ledger.outbox.tx() as tx:
        ledger.record_command(tx, "c-1", "ping", "SUCCEEDED", None, None)
        ledger.mark_announced(tx, "c-1", "SUCCEEDED")
        tx.put("fleet/v1/dev/d/res", b"{}")
        raise RuntimeError("crash before the commit")
    assert ledger.stored_command("c-1") is None
    assert ledger.announced("c-1") == set()
    assert ledger.outbox.count() == 0


def test_the_tables_survive_a_new_ledger_on_the_same_database(tmp_path: Path) -> None:
    first = Ledger(Outbox(tmp_path))
    with first.outbox.tx() as tx:
        first.record_command(tx, "c-1", "status", "SUCCEEDED", None, None)
        first.mark_announced(tx, "c-1", "SUCCEEDED")
    first.outbox.close()
    again = Ledger(Outbox(tmp_path))
    assert again.stored_command("c-1") == StoredCommand("SUCCEEDED", None, None)
    assert again.announced("c-1") == {"SUCCEEDED"}


def test_prune_keeps_the_newest_records_and_drops_pruned_jobs_announcements(
    ledger: Ledger,
) -> None:
    with ledger.outbox.tx() as tx:
        for i in range(1200):  # past the 500-value chunks of one DELETE
            ledger.record_command(tx, f"c-{i:04d}", "ping", "SUCCEEDED", None, None)
            ledger.mark_announced(tx, f"c-{i:04d}", "SUCCEEDED")
        for j in ("j-old", "j-kept"):
            ledger.mark_announced(tx, j, "ACCEPTED")
        for name in ("crash:j-old", "crash:j-kept"):
            tx.next_seq(name)
            tx.next_seq(name)
    # ts decides which records are newest: make them distinct and ordered by index.
    with ledger.outbox.tx() as tx:
        tx.conn.execute("UPDATE commands SET ts = 1000 + CAST(substr(id, 3) AS INTEGER)")
    with ledger.outbox.tx() as tx:
        forgotten = ledger.prune(tx, older_than=1100.5, keep_commands=50, job_ids=["j-old"])
        tx.drop_counters(["crash:j-old"])
    assert len(forgotten) == 1150
    assert ledger.stored_command("c-1149") is None
    assert ledger.stored_command("c-1150") is not None
    assert ledger.announced("c-0000") == set() and ledger.announced("c-1199") == {"SUCCEEDED"}
    assert ledger.announced("j-old") == set() and ledger.announced("j-kept") == {"ACCEPTED"}
    with ledger.outbox.tx() as tx:
        assert tx.next_seq("crash:j-old") == 0  # forgotten: counts from the start again
        assert tx.next_seq("crash:j-kept") == 2
    # By age: everything older than now goes, whatever keep_commands allows.
    with ledger.outbox.tx() as tx:
        assert len(ledger.prune(tx, older_than=time.time(), keep_commands=10_000,
                                job_ids=[])) == 50
