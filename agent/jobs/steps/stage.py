"""stage: the new version in the standby slot, ``current`` untouched. A fine-tune is signed
with the device's key and verified against the trusted keys like any pulled version; a deploy
stages the pulled registry version (already there when pull fetched it)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.jobs.protocol import (
    JobContext,
    StepContext,
    child_main,
    crash_inside_child,
    read_output,
    run_child,
    step_context,
)
from agent.jobs.spec import DeployJob
from agent.jobs.steps import pull
from agent.jobs.steps.health import anchor_of


def run(ctx: JobContext) -> dict[str, Any]:
    if isinstance(ctx.spec, DeployJob):
        made = ctx.outputs.get("personalize", {})
        if made.get("personalized"):
            return run_child(ctx, __name__, "stage", step_context(
                ctx, personalized=Path(made["path"])))
        pulled = ctx.outputs["pull"]
        if pulled.get("fetched"):
            return {"version": pulled["version"], "slot": pulled["slot"],
                    "sequence": pulled["sequence"],
                    **({"manifest_sha256": pulled["manifest_sha256"]}
                       if "manifest_sha256" in pulled else {})}
        # The version is active already: nothing new to stage.
        return run_child(ctx, pull.__name__, "fetch", step_context(ctx))
    return run_child(ctx, __name__, "stage", step_context(ctx))


def child(c: StepContext) -> dict[str, Any]:
    from agent.spool.lineage import with_training_data
    from agent.storage.slots import ModelSlots, read_installed
    from agent.storage.trust import load_trusted
    from agent.storage.update import next_local_sequence, stage_local
    from hpc_core.model_spec import read_checkpoint
    from registry.atomic import write_bytes_atomic
    from registry.publish import collect_artefacts
    from registry.signing import load_signing_key
    from registry.upload import default_version

    key = load_signing_key(c.signing_key)
    # The upstream as pull left it (a slot, or the job's copy of a fetched version).
    parent = read_installed(c.upstream_path, "upstream") if c.upstream_path else None
    if parent is None:
        raise RuntimeError(f"the upstream {c.upstream_path} is incomplete")
    # The version name is fixed once, so a restarted stage rebuilds the very same version.
    vfile = c.job_dir / "stage_version.txt"
    if not vfile.is_file():
        # Named after the lineage's upstream release and the sequence it will sign: unique on
        # this device for any chain of fine-tunes (the manifest keeps the lineage itself).
        seq = next_local_sequence(ModelSlots(c.state_dir, parent.manifest.name), parent)
        name = default_version(parent.manifest.base_release.version, key.name, seq)
        write_bytes_atomic(vfile, name.encode())
    crash_inside_child("stage")  # the version is fixed, nothing is staged yet
    # A fine-tune's checkpoint names the data it learned from (the job's data.json); a
    # personalized release names the parts it kept. Its tensors are checked against the
    # upstream's recorded layout where the spec is the same (a torchvision/timm model's: the
    # fine-tune loaded them into that very module), rather than against a module built here,
    # which imports torch and the model's library (~2.5 CPU-s, ~250 MB) to stage one file.
    content = personalized_content(c, parent.manifest) if c.personalized is not None else \
        with_training_data(read_checkpoint(c.finetuned,  # type: ignore[arg-type]
                                           layout=parent.manifest.layout), c.job_dir)
    staged = stage_local(
        content, state_dir=c.state_dir, parent=parent,
        version=vfile.read_text().strip(), key=key, trusted=load_trusted(c.trusted_keys),
        # The upstream's anchor set travels with every fine-tune of it, so the next
        # fine-tune on the device is held to the same forgetting gate.
        artefacts=collect_artefacts([*c.artefacts, *anchor_of(parent.path)]),
    )
    # The digest of what was staged: commit switches only to these very weights.
    return {"version": staged.version, "slot": staged.slot,
            "sequence": staged.manifest.sequence, "signer": key.name,
            "manifest_sha256": staged.manifest_sha256}


def personalized_content(c: StepContext, release: Any) -> Any:
    """The personalize step's weights as a version of ``release`` (its manifest): the
    release's model and training record, less its metrics (they describe the release's own
    weights), plus what was kept of the device's model and from which of its versions."""
    from registry.manifest import PersonalInfo
    from registry.publish import VersionContent
    from registry.safetensors_io import read_safetensors_index

    made = read_output(c.job_dir / "personalize.json")
    folder = Path(c.personalized)  # type: ignore[arg-type]
    training = release.training.model_copy(update={
        "metrics": {}, "data": None,
        "personal": PersonalInfo(parts=tuple(made["parts"]), own_version=made["own_version"])})
    return VersionContent(folder, release.model, training,
                          read_safetensors_index(folder / "model.safetensors"), release.layout)


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {"stage": child}
"""This step's torch halves by name: ``python -m agent.jobs.steps.stage NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
