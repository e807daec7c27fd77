"""evaluate: a registry version scored on this device's held-out data, never installed.

The candidate was verified into the job folder by ``pull`` (like a fine-tune's upstream);
the baseline (``evaluate.baseline``: an installed version, else fetched and verified the same
way; null: the active model) is scored beside it on the very same samples, through the
runtime the health check uses (the slot's ONNX artefact where there is one, else PyTorch),
by the model's task (``agent.jobs.held_out``): ``metric`` is its gate metric (top-1 of a
classifier, also under ``accuracy``; mAP of a detector). Upstream's publish gates read the
two (``hpc-train publish --device-evals``). With ``evaluate.personal`` the candidate is also
scored personalized (``personalized``): the parts named taken from the device's own active
model (``agent.finetune.personal``), in torch, on the same samples."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.jobs.protocol import (
    JobContext,
    StepContext,
    StepFailed,
    child_main,
    run_child,
    step_context,
    trusted_keys,
)


def _baseline(ctx: JobContext) -> tuple[str | None, Path | None]:
    """(version, folder) of what the candidate is compared with; (None, None): nothing."""
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    want = ctx.spec.evaluate.baseline
    if want is None:
        return _active(ctx)
    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    try:
        installed = slots.installed(want)
    except RegistryError:
        installed = None
    if installed is not None:
        return installed.version, installed.path
    if not ctx.spec.registry:
        raise StepFailed("evaluate", f"baseline {ctx.spec.model}@{want} is not on this device "
                         "and the job has no registry to fetch it from", code="NOT_FOUND")
    from agent.storage.update import fetch_training_source
    from registry.refs import Ref

    try:
        _, source = fetch_training_source(
            Ref(ctx.spec.model, want, ctx.spec.registry), ctx.job_dir / "baseline",
            state_dir=ctx.state_dir, trusted=trusted_keys(ctx))
    except RegistryError as e:
        raise StepFailed("evaluate", f"baseline {ctx.spec.model}@{want}: {e}") from None
    return source.version, source.path


def _active(ctx: JobContext) -> tuple[str | None, Path | None]:
    """(version, slot) of the device's own model, its active one: the default baseline and
    the source of the personal parts."""
    from agent.storage.slots import ModelSlots

    active = ModelSlots(ctx.state_dir, ctx.spec.model).active()
    return (active.version, active.path) if active is not None else (None, None)


def run(ctx: JobContext) -> dict[str, Any]:
    version, path = _baseline(ctx)
    own_version, own_path = _active(ctx) if ctx.spec.evaluate.personal else (None, None)
    out = run_child(ctx, __name__, "evaluate", step_context(
        ctx, active_path=path, staged_path=Path(ctx.outputs["pull"]["path"]),
        own_path=own_path))
    out["version"] = ctx.outputs["pull"]["version"]
    if "baseline" in out:
        out["baseline"]["version"] = version
    if out.get("personalized") is not None:
        out["personalized"]["own_version"] = own_version
    return out


# -- the child's half -------------------------------------------------------------------------


def child(c: StepContext) -> dict[str, Any]:
    from agent.jobs.held_out import finite, held_out_data
    from agent.jobs.steps.health import infer_batch, runner_for
    from exporters.runtime import predict

    samples = c.spec["evaluate"].get("samples")
    held = held_out_data(c, samples)
    if held.targets is None:
        raise ValueError("evaluate needs labelled data: data is unset")
    out: dict[str, Any] = {"samples": len(held), "gate_metric": held.gate_metric}
    roles = {"candidate": c.staged_path, "baseline": c.active_path}
    for role, path in roles.items():
        if path is None:
            continue
        runner, runtime = runner_for(Path(path))
        outputs = predict(runner, held.inputs, batch=infer_batch(c))
        ok = finite(outputs)
        # A model with non-finite outputs scores 0 (not its undefined metric): the device
        # evaluated it, and it is the worst there is.
        figures = held.figures(outputs) if ok else held.worst()
        out[role] = {**figures, "runtime": runtime, "finite": ok}
    out["accuracy"] = out["candidate"]["accuracy"]
    out["metric"] = out["candidate"]["metric"]
    if "baseline" in out:
        out["gain_pts"] = round(100 * (out["metric"] - out["baseline"]["metric"]), 3)
    parts = c.spec["evaluate"].get("personal") or []
    if parts:
        out["personalized"] = _personalized(c, held, parts)
    return out


def _personalized(c: StepContext, held: Any, parts: list[str]) -> dict[str, Any] | None:
    """The candidate with the device's own ``parts`` in place, scored in torch on the same
    held-out samples (None: the device has no model of its own)."""
    if c.own_path is None:
        return None
    from agent.finetune.model import load_upstream
    from agent.finetune.personal import personalize
    from agent.jobs.held_out import finite
    from agent.jobs.steps.health import infer_batch
    from exporters.runtime import TorchRunner, predict

    model, _ = load_upstream(Path(c.staged_path))  # type: ignore[arg-type]
    own, _ = load_upstream(c.own_path)
    tensors = personalize(model, own, parts)  # type: ignore[arg-type]
    del own
    outputs = predict(TorchRunner(model.eval()), held.inputs, batch=infer_batch(c))
    ok = finite(outputs)
    figures = held.figures(outputs) if ok else held.worst()
    return {**figures, "runtime": "torch", "finite": ok, "parts": parts, "tensors": tensors}


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {"evaluate": child}
"""This step's torch halves by name: ``python -m agent.jobs.steps.evaluate NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
