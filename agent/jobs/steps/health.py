"""health: the staged and the active model scored on the same held-out device data (the gate
metric of the model's task: top-1 accuracy of a classifier, mAP of a detector; latency; finite
outputs) against the job's health thresholds, and on the upstream's anchor set
(``artefacts/anchor.npz``, the upstream distribution's held-out data) against forgetting. Its
verdict picks the machine's next state: commit or rollback."""

from __future__ import annotations

import math
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
)

ANCHOR = "anchor.safetensors"
"""The artefact an upstream version ships its anchor set as: tensors x (N,H,W or N,C,H,W,
uint8 0-255 or float 0-1, like device data) and y (labels), in safetensors (the registry
refuses pickle containers, .npz among them)."""
MAX_ANCHOR_SAMPLES = 2000
"""Anchor samples scored at most: the gate needs a few hundred, the health child's budget
is the fine-tune's."""


def anchor_of(slot: Path) -> list[Path]:
    """The version's anchor set, if it ships one."""
    path = slot / "artefacts" / ANCHOR
    return [path] if path.is_file() and not path.is_symlink() else []


def run(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    active, staged = slots.active(), slots.standby()
    mine = ctx.outputs["stage"]
    if staged is None or not staged.holds(mine["version"], mine.get("manifest_sha256")):
        raise StepFailed("health", f"the version this job staged, {mine['version']}, is no "
                         "longer in the standby slot: another job or a pull replaced it")
    # A device with no active model yet compares against the upstream it started from.
    reference = active.path if active is not None else ctx.outputs["pull"].get("path")
    return run_child(ctx, __name__, "health", step_context(
        ctx, active_path=reference, staged_path=staged.path))


# -- the child's half -------------------------------------------------------------------------


def runner_for(slot: Path) -> tuple[Any, str]:
    """What scores a version: the very runtime that serves it (``agent.runtime.engines
    .engine_for``: its TensorRT engine where one was built for this host, else its ONNX file
    in ONNX Runtime with the best provider, its threads asleep between runs as the serving
    runtime's are: no core spins beside the application), so a committed model was checked as
    it runs; a version with no exported artefact (an upstream checkpoint) in torch."""
    from agent.runtime.engines import ARTEFACTS, ENGINE_FILE, ONNX_FILE, engine_for

    if any((slot / ARTEFACTS / f).is_file() for f in (ONNX_FILE, ENGINE_FILE)):
        engine = engine_for(slot, spin=False)
        runtime = f"{engine.name} ({', '.join(engine.providers)})"
        return (_DetectionsOf(engine) if _DetectionsOf.serves(engine) else engine), runtime
    from agent.finetune.model import load_upstream
    from exporters.runtime import TorchRunner

    model, _ = load_upstream(slot)
    return TorchRunner(model.eval()), "torch"


class _DetectionsOf:
    """An exported detector's engine read as a PyTorch detector answers: per image
    ``{"boxes", "scores", "labels"}`` from its four padded outputs
    (:mod:`exporters.detection.outputs`), so the held-out scorer takes either runtime."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @staticmethod
    def serves(engine: Any) -> bool:
        from exporters.detection.outputs import OUTPUT_NAMES

        return set(OUTPUT_NAMES) <= {o.name for o in engine.outputs}

    def __call__(self, x: Any) -> list[dict[str, Any]]:
        from exporters.detection.outputs import OUTPUT_NAMES, model_detections

        out = self.engine(x)
        return model_detections([out[name] for name in OUTPUT_NAMES])


INFER_BATCH = 64
"""Samples per scoring batch where no memory plan says more (a deploy, a given micro-batch)."""


def infer_batch(c: StepContext) -> int:
    """Scoring batch: the fine-tune's planned micro-batch (its training step fitted the
    job's budget; scoring the same batch costs less), else :data:`INFER_BATCH`. Scoring 539
    48-px samples in batches of 256 once took the health child alone past the budget."""
    return min(c.micro_batch, 256) if c.micro_batch else INFER_BATCH


def child(c: StepContext) -> dict[str, Any]:
    import numpy as np

    import hpc_core.data  # noqa: F401 - imported before the drop below, not inside its peak
    from agent.finetune.cold_pages import drop_cold_pages
    from agent.jobs.held_out import finite, held_out_data
    from exporters.runtime import batch_of, measure_latency, predict

    # torch's start-up code, out of the resident set before the held-out data is built: on a
    # fresh install (large page-cache folios) it kept this child's peak ~40 MB above the
    # fine-tune's, in a spike too short for a 10 ms sampler to see every time.
    drop_cold_pages()
    opts = c.spec["health"]
    held = held_out_data(c, opts["samples"])
    x, labelled = held.inputs, held.targets is not None
    batch = infer_batch(c)
    out: dict[str, Any] = {"samples": len(x)}
    if labelled:
        out["gate_metric"] = held.gate_metric
    paths = {"active": c.active_path, "staged": c.staged_path}
    roles = ("active", "staged") if c.active_path else ("staged",)
    failures = []
    for role in roles:
        runner, runtime = runner_for(Path(paths[role]))  # type: ignore[arg-type]
        drop_cold_pages()  # and the runtime's (ONNX Runtime's, the first time)
        outputs = predict(runner, x, batch=batch)
        figures = held.figures(outputs) if labelled else {"accuracy": None}
        lat = measure_latency(runner, batch_of(x, 1), warmup=5, iters=50)
        out[role] = {**figures, "p50_ms_b1": lat.p50_ms, "runtime": runtime}
        if role == "staged" and not finite(outputs):
            failures.append("the staged model gives non-finite outputs")
    anchor = anchor_of(Path(c.staged_path))  # type: ignore[arg-type]
    if anchor and "active" in out:
        failures += _anchor_gate(c, out, anchor[0], paths, batch)
    if not labelled or "active" not in out:
        out["passed"], out["failures"] = not failures, failures
        return out
    a, s = out["active"], out["staged"]
    failures += health_failures(a, s, opts, held.gate_label)
    out["latency_ratio"] = round(float(np.float64(_latency_ratio(a, s))), 3)
    out["passed"], out["failures"] = not failures, failures
    return out


def _latency_ratio(active: dict[str, Any], staged: dict[str, Any]) -> float:
    return staged["p50_ms_b1"] / max(active["p50_ms_b1"], 1e-9)


def health_failures(active: dict[str, Any], staged: dict[str, Any],
                    opts: dict[str, Any], label: str = "accuracy") -> list[str]:
    """Why the staged model fails its health check against the active one, on the same
    held-out data (each one's gate metric, ``metric``: top-1 accuracy of a classifier, mAP of
    a detector, as the model's task scores it; and ``p50_ms_b1``): one line per broken
    threshold of the job's ``health`` options; none, and the job commits it, else it is
    rolled back. Its gate metric may not be undefined (``nan``: it never passes), lose more
    than ``max_accuracy_drop_pts`` points, fall below ``min_accuracy``, or run slower than
    ``max_latency_ratio`` times the active model (a null threshold is not checked).
    ``label`` names the metric in each line (the task's ``gate_label``)."""
    from agent.jobs.held_out import metric_of
    from hpc_core.tasks import passes

    failures = []
    a, s = metric_of(active), metric_of(staged)
    if math.isnan(s):
        failures.append(f"{label} of the staged model is undefined (nan: nothing in the "
                        "held-out data to score it on, or non-finite outputs): it never passes")
    # The difference in points first, as the threshold is given: 100 * (0.91 - 0.88) is
    # 3.0000000000000027, and a classifier's verdicts stay what they were.
    drop = 100 * (a - s)
    if drop > opts["max_accuracy_drop_pts"]:
        failures.append(f"{label} {100 * s:.1f}% is {drop:.1f} points below the "
                        f"active model's {100 * a:.1f}% "
                        f"(health.max_accuracy_drop_pts={opts['max_accuracy_drop_pts']})")
    if opts["min_accuracy"] is not None and not math.isnan(s) and not passes(
            s, opts["min_accuracy"]):
        failures.append(f"{label} {100 * s:.1f}% is below health.min_accuracy="
                        f"{opts['min_accuracy']}")
    ratio = _latency_ratio(active, staged)
    if opts["max_latency_ratio"] is not None and ratio > opts["max_latency_ratio"]:
        failures.append(f"latency p50 {staged['p50_ms_b1']:.2f} ms is {ratio:.2f}x the active "
                        f"model's (health.max_latency_ratio={opts['max_latency_ratio']})")
    return failures


def _anchor_gate(c: StepContext, out: dict[str, Any], anchor: Path, paths: dict[str, Any],
                 batch: int) -> list[str]:
    """Score both models on the anchor set (labelled images of the upstream distribution,
    scored by the model's task); the staged one may not fall more than
    health.max_anchor_drop_pts below the active one."""
    from safetensors.numpy import load_file

    from agent.finetune.model import load_upstream
    from agent.jobs.held_out import HeldOut
    from exporters.runtime import predict
    from hpc_core.data import images_from_arrays

    _, m = load_upstream(Path(paths["staged"]))
    arrays = load_file(anchor)
    if not {"x", "y"} <= set(arrays):
        raise StepFailed("health", f"the anchor set {anchor} needs tensors x and y, has "
                         f"{sorted(arrays)}")
    x, y = images_from_arrays(arrays["x"], arrays["y"], m.image_size, f"anchor set {anchor}")
    held = HeldOut(m.task, x[:MAX_ANCHOR_SAMPLES].numpy(), y[:MAX_ANCHOR_SAMPLES].numpy())
    acc = {}
    for role in ("active", "staged"):
        runner, _ = runner_for(Path(paths[role]))
        acc[role] = held.figures(predict(runner, held.inputs, batch=batch))["metric"]
    drop = 100 * (acc["active"] - acc["staged"])
    limit = c.spec["health"].get("max_anchor_drop_pts")
    out["anchor"] = {"samples": len(held), "active_accuracy": acc["active"],
                     "staged_accuracy": acc["staged"], "drop_pts": round(drop, 2),
                     "max_drop_pts": limit}
    if limit is not None and drop > limit:
        return [f"forgetting: {held.gate_label} on the upstream's anchor set "
                f"{100 * acc['staged']:.1f}% is {drop:.1f} points below the active model's "
                f"{100 * acc['active']:.1f}% (health.max_anchor_drop_pts={limit})"]
    return []


CHILDREN: dict[str, Callable[[StepContext], dict[str, Any]]] = {"health": child}
"""This step's torch halves by name: ``python -m agent.jobs.steps.health NAME JOB_DIR``
(:func:`agent.jobs.protocol.child_main`)."""

if __name__ == "__main__":
    sys.exit(child_main(CHILDREN))
