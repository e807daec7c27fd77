"""personalize: personalized serving. A deploy with ``personal`` keeps the parts named
(``head``, ``norm``: ``agent.finetune.personal``) of the device's own model, its active one,
in the release it takes; stage then signs the result with the device's key as the device's own
version of the release (its lineage names the release, anti-rollback as for a fine-tune), and
health checks it like any staged version.

A device with no model of its own yet (nothing active), or whose active model is the release
itself, has nothing to keep: pull staged the release as published and this step says why it
made nothing. A device's own model of another architecture is refused (the step fails and
nothing is staged)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.jobs.protocol import (
    JobContext,
    StepContext,
    child_main,
    run_child,
    step_context,
)

WEIGHTS = "personalized"
"""The job folder's sub-folder holding the personalized weights (model.safetensors)."""


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    pulled = ctx.outputs["pull"]
    active = ModelSlots(ctx.state_dir, ctx.spec.model).active()
    if active is None or not pulled.get("training_source"):
        # pull fetched into a slot only when there is nothing to personalize with
        # (agent.jobs.steps.pull.child_fetch): the release is staged as published.
        why = ("no model of its own yet" if active is None
               else f"{pulled['version']} is the active model already")
        return {"personalized": False, "reason": why}
    return run_child(ctx, __name__, "personalize", step_context(ctx, own_path=active.path))


def child(c: StepContext) -> dict[str, Any]:
    from safetensors.torch import save_file

    from agent.finetune.model import load_upstream
    from agent.finetune.personal import personalize
    from registry.manifest import Manifest

    parts = list(c.spec["personal"])
    own_manifest = Path(c.own_path) / "manifest.json"  # type: ignore[arg-type]
    own_version = Manifest.from_bytes(own_manifest.read_bytes(), source=str(own_manifest)).version
    model, _ = load_upstream(Path(c.upstream_path))  # type: ignore[arg-type]
    own, _ = load_upstream(c.own_path)  # type: ignore[arg-type]
    tensors = personalize(model, own, parts)
    del own
    out = c.job_dir / WEIGHTS
    out.mkdir(exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(out / "model.safetensors")
    return {"personalized": True, "parts": parts, "tensors": tensors, "path": str(out),
            "own_version": own_version}


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {"personalize": child}
"""This step's torch half: ``python -m agent.jobs.steps.personalize NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
