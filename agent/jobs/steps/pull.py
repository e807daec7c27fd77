"""pull: the version the job starts from, verified (signature against the trusted keys, every
tensor's hash).

Installed: re-verified in place; a fine-tune's upstream in the standby slot is first copied
into the job folder (the stage step replaces that slot). Not on the device: fetched from the
job's registry in a child (``fetch``): a deploy stages it into the standby slot (the active
model stays; anti-rollback by lineage, ``agent.storage.slots``); a fine-tune only trains from
it (a personalized deploy only makes its own version from it), so it goes into the job
folder, never a slot, and may be older than the newest version
installed (what the job commits is its own new, higher version).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.jobs.protocol import (
    JobContext,
    StepContext,
    StepFailed,
    child_main,
    crash_inside_child,
    run_child,
    step_context,
    trusted_keys,
)
from agent.jobs.spec import DeployJob


def pulled_model(ctx: JobContext) -> Any:
    """The model spec (``registry.model_config.ModelConfig``) of the version this job pulled,
    from its verified manifest, torch-free: what the later steps ask of it (its task)."""
    from registry.manifest import Manifest

    slot = Path(ctx.outputs["pull"]["path"])
    return Manifest.from_bytes((slot / "manifest.json").read_bytes(), source=str(slot)).model


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.lock import StateLock
    from agent.storage.slots import ModelSlots, read_installed
    from agent.storage.verify import verify_slot
    from registry.errors import RegistryError

    spec = ctx.spec
    slots = ModelSlots(ctx.state_dir, spec.model)
    active = slots.active()
    try:
        base = slots.installed(spec.version) if active is not None else None
    except RegistryError:
        base = None
    deploying_other = isinstance(spec, DeployJob) and base is not None and (
        base.slot != getattr(active, "slot", None))
    if base is None or deploying_other:
        if spec.version is None:
            raise StepFailed("pull", f"no model {spec.model!r} is installed: give --version "
                             "and --registry to fetch one", code="NOT_FOUND")
        if not spec.registry:
            raise StepFailed("pull", f"{spec.model}@{spec.version} is not on this device and "
                             "the job has no registry to fetch it from: set registry.url in "
                             "agent.yaml (agentctl: --registry)", code="NOT_FOUND")
        out = run_child(ctx, __name__, "fetch", step_context(ctx))
        out["active"] = active.version if active else None
        return out
    if active is not None and base.slot != active.slot:
        # The standby slot is what the stage step replaces: train from a copy that outlives it.
        copy, tmp = ctx.job_dir / "upstream", ctx.job_dir / "upstream.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with StateLock(ctx.state_dir):
            shutil.copytree(base.path, tmp, symlinks=True)
        shutil.rmtree(copy, ignore_errors=True)
        tmp.rename(copy)
        copied = read_installed(copy, "upstream")
        if copied is None:
            raise StepFailed("pull", f"the copy of {base.path} in {copy} is incomplete")
        base = copied
    try:
        verify_slot(base.path, trusted_keys(ctx))
    except Exception as e:
        raise StepFailed("pull", str(e)) from None
    return {"version": base.version, "path": str(base.path), "slot": base.slot,
            "sequence": base.manifest.sequence, "fetched": False,
            "active": active.version if active else None}


def child_fetch(c: StepContext) -> dict[str, Any]:
    """Pull a registry version (manifest verified before any chunk, every chunk hashed).

    A deploy stages it into the standby slot (the active model is not touched; a possible
    rollback is refused). A fine-tune only trains from it and an evaluate only scores it: it
    goes to JOB_DIR/upstream and never into a slot (``fetch_training_source``)."""
    from agent.storage.chunk_store import ChunkStore
    from agent.storage.slots import ModelSlots
    from agent.storage.trust import load_trusted
    from agent.storage.update import fetch_training_source, pull
    from registry.refs import Ref

    spec = c.spec
    ref = Ref(spec["model"], spec["version"], spec["registry"])
    trusted = load_trusted(c.trusted_keys)
    # A personalized deploy stages the device's own version of the release (the personalize
    # and stage steps), never the release itself: like a fine-tune's upstream, it is only
    # made from. With no model of its own to personalize with, it deploys as published.
    personal = bool(spec.get("personal")) and ModelSlots(c.state_dir, ref.name).active() \
        is not None
    if "finetune" in spec or "evaluate" in spec or personal:
        pulled, source = fetch_training_source(ref, c.job_dir / "upstream",
                                               state_dir=c.state_dir, trusted=trusted)
        crash_inside_child("pull")  # fetched, not yet recorded: a restart fetches again
        return {"version": source.version, "path": str(source.path), "slot": source.slot,
                "sequence": source.manifest.sequence, "fetched": True, "training_source": True,
                "chunks_fetched": pulled.chunks_fetched, "bytes_fetched": pulled.bytes_fetched}
    pulled = pull(ref, state_dir=c.state_dir, trusted=trusted)
    crash_inside_child("pull")  # the chunks are in, nothing staged yet
    v, slots = pulled.verified, ModelSlots(c.state_dir, ref.name)
    active = slots.active()
    if active is not None and active.version == ref.version:
        staged = active
    else:
        staged = slots.stage(v.manifest, v.manifest_bytes, v.signature_bytes,
                             ChunkStore(c.state_dir), v.key, release=pulled.release)
    return {"version": staged.version, "path": str(Path(staged.path)), "slot": staged.slot,
            "sequence": staged.manifest.sequence, "manifest_sha256": staged.manifest_sha256,
            "fetched": True,
            "chunks_fetched": pulled.chunks_fetched, "bytes_fetched": pulled.bytes_fetched}


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {"fetch": child_fetch}
"""This step's torch halves by name: ``python -m agent.jobs.steps.pull NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
