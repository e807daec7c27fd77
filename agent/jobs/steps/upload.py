"""upload: the committed model, signed by this device, published as a child of its upstream
to the configured registry (the fleet combines the devices' updates upstream).

Idempotent: a re-run after a crash that finds the version in the registry accepts it when it
is signed by this device's key, has the same parent and the very same tensors (the upload
finished before the crash); anything else there is a conflict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.jobs.protocol import JobContext, StepFailed
from agent.jobs.steps.context import export_artefacts, signing_key_path, trusted_keys


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import read_installed
    from hpc_core.model_spec import read_checkpoint
    from registry.errors import VersionExistsError
    from registry.signing import load_signing_key
    from registry.upload import upload as publish

    target = str(ctx.spec.upload.registry or ctx.spec.registry)
    pulled = ctx.outputs["pull"]
    parent = read_installed(Path(pulled["path"]), pulled["slot"])
    if parent is None:
        raise StepFailed("upload", f"the upstream {pulled['path']} is gone")
    key = load_signing_key(signing_key_path(ctx))
    version = ctx.spec.upload.version or ctx.outputs["stage"]["version"]
    artefacts = [Path(a) for a in export_artefacts(ctx.outputs)]
    content = read_checkpoint(Path(ctx.outputs["finetune"]["checkpoint"]))
    try:
        report = publish(
            content, parent=parent.manifest, target=target, key=key, version=version,
            artefacts=artefacts,
            metrics={"device/acc": ctx.outputs["health"]["staged"]["accuracy"]},
        )
        m, uri = report.manifest, report.uri
    except VersionExistsError:
        m, uri = _uploaded_before(ctx, target, version, parent.version, key), target
    return {"version": m.version, "parent": m.parent, "sequence": m.sequence, "uri": str(uri),
            "signer": m.signer.name}


def _uploaded_before(ctx: JobContext, target: str, version: str, parent: str,
                     key: Any) -> Any:
    from agent.storage.slots import ModelSlots
    from registry.pull import fetch_verified_manifest
    from registry.refs import Ref
    from registry.stores import open_store
    from registry.transfer import TransferConfig

    cfg = TransferConfig()
    ref = Ref(ctx.spec.model, version, target)
    got = fetch_verified_manifest(open_store(target, cfg), ref, trusted_keys(ctx),
                                  cfg).manifest
    # The committed version was signed from the very same checkpoint: its tensor hashes are
    # the upload's.
    staged = ModelSlots(ctx.state_dir, ctx.spec.model).installed(ctx.outputs["stage"]["version"])
    ours = {t.name: t.sha256 for t in staged.manifest.tensors}
    theirs = {t.name: t.sha256 for t in got.tensors}
    if got.parent != parent or theirs != ours or got.signer.key_id != key.key_id:
        raise StepFailed("upload", f"{ctx.spec.model}@{version} is already in {target} with "
                         f"other content (parent {got.parent}, signer {got.signer.name}): set "
                         "upload.version to a new name", code="JOB_FAILED")
    return got
