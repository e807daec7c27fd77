"""upload: the committed model, signed by this device, published as a child of its upstream
to the configured registry (the fleet combines the devices' updates upstream).

Idempotent: a re-run after a crash that finds the version in the registry accepts it when it
is signed by this device's key, has the same parent and the very same tensors (the upload
finished before the crash); anything else there is a conflict."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.jobs.protocol import (
    JobContext,
    StepFailed,
    export_artefacts,
    signing_key_path,
    trusted_keys,
)

if TYPE_CHECKING:
    from registry.manifest import LayoutRecord


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.spool.lineage import with_training_data
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
    checkpoint = Path(ctx.outputs["finetune"]["checkpoint"])
    content = with_training_data(read_checkpoint(checkpoint, layout=_staged_layout(ctx)),
                                 ctx.job_dir)
    try:
        report = publish(
            content, parent=parent.manifest, target=target, key=key, version=version,
            artefacts=artefacts,
            metrics=update_metrics(ctx.outputs),
        )
        m, uri = report.manifest, report.uri
    except VersionExistsError:
        m, uri = _uploaded_before(ctx, target, version, parent.version, key), target
    return {"version": m.version, "parent": m.parent, "sequence": m.sequence, "uri": str(uri),
            "signer": m.signer.name}


def _staged_layout(ctx: JobContext) -> LayoutRecord | None:
    """The layout the stage step's child recorded for these very weights (an ecosystem
    model's, torchvision's or timm's, built there on meta tensors), read from the version this
    job committed: the worker uses it rather than import torch and the model's library to
    build it again. None where the active version is no longer the one this job staged."""
    from agent.storage.slots import ModelSlots

    stage = ctx.outputs["stage"]
    active = ModelSlots(ctx.state_dir, ctx.spec.model).active()
    if active is None or not active.holds(stage["version"], stage.get("manifest_sha256")):
        return None
    return active.manifest.layout


def update_metrics(outputs: dict[str, Any]) -> dict[str, float]:
    """What upstream needs to combine this update with the fleet's (``hpc-train aggregate``):
    how many samples and steps it learned from (FedAvg weights by samples), how much of the
    model it trained, and its task's gate metric (top-1 accuracy, mAP) before and after on this
    device's held-out data.
    Counts and figures only: no sample leaves the device."""
    health, ft = outputs["health"], outputs["finetune"]
    # The task's gate metric under its own name: device/acc of a classifier, device/map of a
    # detector (a job recorded before the task seam scored top-1).
    gate = health.get("gate_metric", "acc")
    staged = health["staged"]
    out = {f"device/{gate}": staged.get("metric", staged.get("accuracy")),
           "train/steps": ft["steps"]}
    for key, name in (("train_samples", "train/samples"), ("held_out_samples",
                      "device/held_out_samples"), ("metric_before", f"device/{gate}_before"),
                      ("metric_after", f"device/{gate}_after"),
                      ("accuracy_before", "device/acc_before"),
                      ("accuracy_after", "device/acc_after"),
                      ("trainable_params", "train/trainable_params")):
        if ft.get(key) is not None:  # a job recorded before these existed lacks them
            out[name] = float(ft[key])
    if ft.get("trainable_params") and ft.get("total_params"):
        out["train/trainable_fraction"] = ft["trainable_params"] / ft["total_params"]
    # An undefined figure (nan: nothing to score) is left out: a manifest holds numbers only.
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


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
