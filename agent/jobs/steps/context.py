"""What a step needs beyond the job's outputs: the device's keys (from the job's resolved spec,
i.e. the device's configuration) and the typed context a child step is handed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.jobs.protocol import JobContext, StepContext, read_output
from agent.storage.trust import default_trusted_keys

SETUP = "setup.json"
"""JOB_DIR/setup.json: the fine-tune's resolved set-up (``agent.finetune.setup``), written
once, read by the fine-tune and the steps after it."""


def trusted_dir(ctx: JobContext) -> Path:
    return Path(ctx.spec.trusted_keys or default_trusted_keys(ctx.state_dir))


def trusted_keys(ctx: JobContext) -> Any:
    """The job's trusted keys, checked on disk first (``agent.storage.trust``)."""
    from agent.storage.trust import load_trusted

    return load_trusted(trusted_dir(ctx))


def signing_key_path(ctx: JobContext) -> Path:
    return Path(getattr(ctx.spec, "signing_key", None) or ctx.state_dir / "device.key.pem")


def export_artefacts(outputs: dict[str, Any]) -> list[str]:
    """The files the export step installed (a job exported before model.onnx.json existed
    recorded only ``artefact``)."""
    ex = outputs.get("export", {})
    return list(ex.get("artefacts") or ([ex["artefact"]] if ex.get("artefact") else []))


def step_context(ctx: JobContext, **extra: Any) -> StepContext:
    """The child's view of the job so far: spec, the upstream, the fine-tuned checkpoint, the
    export's files, the set-up, the keys."""
    o = ctx.outputs
    setup = read_output(ctx.job_dir / SETUP) or None
    return StepContext(
        job_id=ctx.job_id, state_dir=ctx.state_dir, job_dir=ctx.job_dir,
        spec=ctx.spec.model_dump(mode="json"),
        upstream_path=o.get("pull", {}).get("path"),
        finetuned=o.get("finetune", {}).get("checkpoint"),
        artefacts=[Path(a) for a in export_artefacts(o)],
        setup=setup, signing_key=signing_key_path(ctx), trusted_keys=trusted_dir(ctx),
        **extra,
    )
