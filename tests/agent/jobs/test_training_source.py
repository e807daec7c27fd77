"""The upstream a fine-tune starts from is a training source, not an install: an older one than
the device's newest fine-tune is fetched (verified) and trained from, while deploys and pulls of
it stay refused by the anti-rollback rule."""

from __future__ import annotations

import pytest

from agent.jobs.store import JobState, JobStore
from agent.storage.slots import ModelSlots
from registry.errors import DowngradeError
from tests.agent.jobs.conftest import Device
from tests.agent.jobs.test_device_job import submit, tree_digest, worker

TINY = {"finetune": {"steps": 4}, "steps": {"export": False, "upload": False},
        "health": {"max_accuracy_drop_pts": 100.0}}
"""Four steps, no export, no upload; health passes on any finite model (this is about pull)."""


def _run(dev: Device, job_id: str) -> dict:
    submit(dev, job_id, **TINY)
    r = worker(dev.state, job_id)
    store = JobStore(dev.state)
    rec, steps = store.get(job_id), {s.name: s for s in store.steps(job_id)}
    store.close()
    assert rec is not None
    assert r.returncode == 0 and rec.state == JobState.SUCCEEDED, (rec.error, r.stderr[-2000:])
    return {"pull": steps["pull"].outputs, "commit": steps["commit"].outputs}


@pytest.mark.slow
def test_three_finetunes_from_v1_in_a_row_then_a_deploy_of_v1_is_still_refused(
    device: Device,
) -> None:
    device.install()  # v1 active, sequence 1
    slots = ModelSlots(device.state, "digits")

    # 1: trains from the active v1; v1 becomes the standby (rollback target).
    one = _run(device, "j1")
    assert one["pull"]["fetched"] is False and one["pull"]["version"] == "v1"
    assert slots.standby().version == "v1"

    # 2: trains from v1 in the standby slot, which its stage step replaces: it works from a copy.
    two = _run(device, "j2")
    assert two["pull"]["version"] == "v1"
    assert two["pull"]["path"] == str(device.state / "jobs/j2/upstream")
    assert {slots.active().version, slots.standby().version} == {
        one["commit"]["version"], two["commit"]["version"]}
    highest = slots.highest_sequence()
    assert highest == 3

    # 3: v1 is on no slot any more and is fetched again though its sequence (1) is below the
    # highest installed (3): only trained from, never staged; the job commits its own version.
    three = _run(device, "j3")
    pulled = three["pull"]
    assert pulled["fetched"] is True and pulled["training_source"] is True
    assert pulled["version"] == "v1" and pulled["sequence"] == 1
    assert pulled["path"] == str(device.state / "jobs/j3/upstream")
    assert slots.active().version == three["commit"]["version"]
    assert slots.active().manifest.sequence == highest + 1 == slots.highest_sequence()
    assert slots.active().manifest.parent == "v1"
    assert "v1" not in (slots.active().version, slots.standby().version)

    # What becomes active stays guarded: a deploy of v1 is refused as a downgrade, the slots
    # untouched; so is `agentctl pull` of it (no --allow-downgrade).
    before = tree_digest(device.state / "models")
    store = JobStore(device.state)
    store.submit("d1", "deploy", {"model": "digits", "version": "v1",
                                  "registry": device.registry.url})
    store.close()
    r = worker(device.state, "d1")
    store = JobStore(device.state)
    rec = store.get("d1")
    store.close()
    assert rec is not None and rec.state == JobState.FAILED, (rec, r.stderr[-2000:])
    assert "DowngradeError" in rec.error["message"] and "below 4" in rec.error["message"]
    assert tree_digest(device.state / "models") == before
    from agent.storage.update import update
    from registry.refs import parse_ref
    from registry.signing import load_trusted_keys

    with pytest.raises(DowngradeError, match="below 4"):
        update(parse_ref("digits@v1", device.registry.url), state_dir=device.state,
               trusted=load_trusted_keys(device.state / "trusted_keys"))
    assert tree_digest(device.state / "models") == before
