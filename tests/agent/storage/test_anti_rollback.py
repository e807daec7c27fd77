"""The anti-rollback rule on its own (agent.storage.anti_rollback): what a device that has
committed some versions still takes, and what it refuses. The slots and the pull apply it
(tests/agent/storage/test_stage.py, test_slots.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent.storage.anti_rollback import (
    InstalledRecord,
    after_commit,
    read_record,
    refuse_downgrade,
    write_record,
)
from registry.errors import CorruptSlotError, DowngradeError, LineageError
from registry.manifest import BaseRelease, Manifest
from tests.support.manifests import manifest_for, model_state


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    m, _ = manifest_for(tmp_path_factory.mktemp("m") / "model.safetensors", model_state())
    return m


def version(m: Manifest, version: str, sequence: int, base: Manifest | None = None) -> Manifest:
    lineage = None if base is None else BaseRelease(version=base.version, sequence=base.sequence)
    return m.model_copy(update={"version": version, "sequence": sequence, "base": lineage})


def test_a_fine_tuned_device_takes_the_next_release_and_refuses_a_replay(
        release: Manifest, caplog: pytest.LogCaptureFixture) -> None:
    r1 = version(release, "1", 1)
    tuned = version(release, "1+jetson-07.1", 4, base=r1)
    r2 = version(release, "2", 3)
    record = InstalledRecord()
    for m, device in ((r1, False), (tuned, True)):
        refuse_downgrade(m, record, model="digits", device_signed=device)
        record = after_commit(record, m, device_signed=device)
    assert record == InstalledRecord(highest_sequence=4, base_sequence=1, lineage_sequence=4)
    refuse_downgrade(r2, record, model="digits", device_signed=False)  # newer, signed below 4
    after_r2 = after_commit(record, r2, device_signed=False)
    with pytest.raises(DowngradeError, match="upstream release has sequence 1, below 3"):
        refuse_downgrade(r1, after_r2, model="digits", device_signed=False)
    with pytest.raises(DowngradeError, match="sequence 2, below 4, the highest committed here"):
        refuse_downgrade(version(release, "1+jetson-07.0", 2, base=r1), record, model="digits",
                         device_signed=True)
    with caplog.at_level(logging.WARNING, logger="agent.storage"):
        refuse_downgrade(r1, after_r2, model="digits", device_signed=False,
                         allow_downgrade=True)
    assert "downgrade allowed" in caplog.text
    assert after_commit(after_r2, r1, device_signed=False) == after_r2  # never back


def test_a_device_signed_version_never_moves_the_upstream_sequence(release: Manifest) -> None:
    """A device key's version counts by the base it names; naming none, it is refused, even
    with the downgrade allowed, and cannot be recorded."""
    r1 = version(release, "1", 1)
    record = after_commit(InstalledRecord(), r1, device_signed=False)
    forged = version(release, "9+jetson-07.x", 1000)  # no base: claims to be a release
    for allow in (False, True):
        with pytest.raises(LineageError, match="names no upstream base"):
            refuse_downgrade(forged, record, model="digits", device_signed=True,
                             allow_downgrade=allow)
    with pytest.raises(LineageError):
        after_commit(record, forged, device_signed=True)
    tuned = version(release, "1+jetson-07.y", 1000, base=r1)
    moved = after_commit(record, tuned, device_signed=True)
    assert (moved.base_sequence, moved.lineage_sequence) == (1, 1000)
    refuse_downgrade(version(release, "2", 2), moved, model="digits", device_signed=False)


def test_the_record_reads_back_and_refuses_to_be_guessed(tmp_path: Path) -> None:
    path = tmp_path / "installed.json"
    assert read_record(path, lambda: None) == InstalledRecord()
    write_record(path, InstalledRecord(5, 3, 5), "5")
    assert json.loads(path.read_text())["version"] == "5"
    assert read_record(path, lambda: None) == InstalledRecord(5, 3, 5)
    path.write_text('{"highest_sequence": 4}')  # from before lineage: the active base stands in
    assert read_record(path, lambda: 2) == InstalledRecord(4, 2, 4)
    assert read_record(path, lambda: None) == InstalledRecord(4, 4, 4)
    for bad in ("{", '{"highest_sequence": -1}', '{"highest_sequence": 4, "base_sequence": 5, '
                '"lineage_sequence": 4}'):
        path.write_text(bad)
        with pytest.raises(CorruptSlotError):
            read_record(path, lambda: None)
