"""The torch side of the device job: ``python -m agent.jobs.child STEP JOB_DIR``.

The worker stays torch-free (~35 MB) so that the memory budget can go to the one torch process
alive at a time: the planner's probes, then this fine-tune, export or health check. Each step
reads ``JOB_DIR/context.json`` (written by the worker) and writes ``JOB_DIR/<step>.json``
atomically when it is done; the worker records that in the store.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hpc_core.atomic import write_bytes_atomic, write_json_atomic

CONTEXT = "context.json"


def _crash_inside(step: str) -> None:
    """Fault injection (``EDGETRAIN_JOB_CRASH_AT=inside:STEP``) for a step too short for the
    worker's wait loop to catch under way: kill -9 of the job process from here, then of
    this child, at a known point of the step's work."""
    from agent.jobs.machine import CRASH_ENV

    if f"inside:{step}" in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def _context(job_dir: Path) -> dict[str, Any]:
    return json.loads((job_dir / CONTEXT).read_text())


def _finetune_job(ctx: dict[str, Any], micro: int | None) -> Any:
    from agent.finetune.job import FinetuneJob

    opts = dict(ctx["spec"]["finetune"])
    opts["micro_batch"] = micro if micro is not None else opts.get("micro_batch")
    return FinetuneJob.model_validate(
        {**opts, "checkpoint": ctx["upstream_path"], "data": ctx["spec"]["data"],
         "out": str(Path(ctx["job_dir"]) / "finetune")}
    )


def step_config(job_dir: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """The training config the planner probes (built by the recipe, which imports torch)."""
    import torch

    from agent.finetune.model import load_upstream
    from agent.finetune.recipe import build_config, pick_precision, resolve_profile

    job = _finetune_job(ctx, None)
    profile = resolve_profile(job.profile)
    device = "cuda" if job.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    _, upstream = load_upstream(job.checkpoint)
    cfg = build_config(job, upstream, pick_precision(job, profile, device), None)
    budget = job.budget_mb if job.budget_mb is not None else float(
        profile.memory.training_budget_mb
    )
    return {"config": cfg.to_dict(), "device": device, "budget_mb": budget}


class StoreHook:
    """Cancel inside the fine-tune at the next optimizer step; progress a few times a second."""

    def __init__(self, state_dir: Path, job_id: str, interval_s: float = 0.5) -> None:
        from agent.jobs.store import JobStore

        self.store, self.job_id, self.interval_s = JobStore(state_dir), job_id, interval_s
        self._last = 0.0

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s and step < trainer.total_steps:
            return
        self._last = now
        # One indexed read; the throttle keeps it off the hot path of tiny steps.
        if self.store.cancel_requested(self.job_id):
            trainer.request_stop("cancel")
        self.store.set_progress(self.job_id, {
            "id": self.job_id, "stage": "finetune", "step": step, "total": trainer.total_steps,
            "pct": round(100 * step / max(trainer.total_steps, 1), 1),
            "detail": {"loss": metrics.get("train/loss"),
                       "micro_batch": trainer.state.micro_batch_size, **_governor(trainer)},
        })


def _governor(trainer: Any) -> dict[str, Any]:
    """The governor's last decision, when one paces this run (its hook keeps ``last``)."""
    for h in getattr(trainer, "hooks", []):
        d = getattr(h, "last", None)
        if d is not None and hasattr(d, "duty"):
            state = getattr(d.state, "value", d.state)
            return {"governor": str(state), "duty": round(float(d.duty), 2),
                    "temp_c": d.temp_c, "limit": d.limit}
    return {}


def step_finetune(job_dir: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """The fine-tune, paced by the thermal/power governor (finetune.sensors), resumed from
    its last checkpoint; its report (report.json/.png) goes to JOB_DIR/finetune."""
    from agent.finetune.recipe import run_paced

    if not (job_dir / "config.json").is_file():  # no plan was needed: the worker made none
        write_json_atomic(job_dir / "config.json", step_config(job_dir, ctx))
    job = _finetune_job(ctx, ctx["plan"]["micro_batch_size"] if ctx.get("plan") else None)
    hook = StoreHook(Path(ctx["state_dir"]), ctx["job_id"])
    result = run_paced(job, resume=True, hooks=[hook])
    r = result.report
    gov = r.get("governor") or {}
    png = job.out / "report.png"  # written only when a governor paced the run
    return {
        "checkpoint": r["checkpoint"], "stopped_reason": r["stopped_reason"], "steps": r["steps"],
        "accuracy_before": r["accuracy_before"], "accuracy_after": r["accuracy_after"],
        "micro_batch_size": r["micro_batch_size"],
        "accumulation_steps": -(-job.effective_batch // r["micro_batch_size"]),
        "peak_rss_mb": r["peak_rss_mb"],
        "precision": r["precision"], "max_temp_c": gov.get("max_temp_c"),
        "target_c": result.target_c, "governor": gov or None,
        "report_png": str(png) if png.is_file() else None,
    }


def step_export(job_dir: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    from exporters.job import ExportJob
    from exporters.pipeline import run_export

    job = ExportJob.model_validate({
        **ctx["spec"]["export"], "checkpoint": ctx["finetuned"],
        "out_dir": str(job_dir / "export"),
    })
    report = run_export(job)
    out: dict[str, Any] = {
        "status": report.status, "winner": report.winner, "artefact": None,
        "fallback_reason": report.fallback_reason, "fallback": report.fallback,
        "isa": ((report.int8 or {}).get("isa") or {}).get("label"),
        "seconds": round(report.seconds, 2),
    }
    if report.status == "passed":
        out["artefact"] = str(job.out_dir / "model.onnx")
        # The file and how it was made (recipe, ISA, excluded layers): staged and signed together.
        out["artefacts"] = [out["artefact"], str(job.out_dir / "model.onnx.json")]
        first = report.attempts[0].measurement if report.attempts else None
        winner = next(a for a in report.attempts if a.passed)
        out["excluded_layers"] = list(winner.excluded)
        out["int8_recipe"] = winner.recipe  # what serves: a fallback step may have changed it
        win = winner.measurement
        if win is not None:
            out["int8_drop_pts"] = getattr(win, "top1_drop_pts", None)
            out["p50_ms_b1"] = getattr(getattr(win, "latency_b1", None), "p50_ms", None)
        if first is not None:
            out["reference_top1"] = getattr(first, "reference_top1", None)
    return out


def _data_config(ctx: dict[str, Any]) -> dict[str, Any] | None:
    """The held-out split's data config: the fine-tune's own, or (a deploy) one built the
    fine-tune's way from the job's data; None when a deploy has no data."""
    if ctx.get("train_config"):
        return dict(ctx["train_config"]["data"])
    if not ctx["spec"].get("data"):
        return None
    from agent.finetune.job import FinetuneJob
    from agent.finetune.model import load_upstream
    from agent.finetune.recipe import build_config

    _, upstream = load_upstream(Path(ctx["staged_path"]))
    job = FinetuneJob(checkpoint=Path(ctx["staged_path"]), data=ctx["spec"]["data"],
                      out=Path(ctx["job_dir"]) / "health")
    return build_config(job, upstream, "fp32", None).data.model_dump(mode="json")


def _held_out(ctx: dict[str, Any], samples: int | None) -> tuple[Any, Any]:
    import numpy as np

    from hpc_core.config import DataConfig
    from hpc_core.data import build_datasets, held_out

    cfg = _data_config(ctx)
    if cfg is None:  # no data: a fixed random batch checks the model loads and stays finite
        from agent.finetune.model import load_upstream

        _, m = load_upstream(Path(ctx["staged_path"]))
        rng = np.random.default_rng(0)
        shape = (32, m.in_channels, m.image_size, m.image_size)
        return rng.random(shape, dtype=np.float32), None
    _, val, _ = build_datasets(DataConfig.model_validate(cfg))
    x, y = held_out(val, samples)
    return np.ascontiguousarray(x), y


def _runner(slot: Path) -> tuple[Any, str]:
    from agent.finetune.model import load_upstream
    from exporters.ort_runner import OrtRunner
    from exporters.runtime import TorchRunner

    onnx = slot / "artefacts" / "model.onnx"
    if onnx.is_file():
        return OrtRunner(onnx), "onnxruntime"
    model, _ = load_upstream(slot)
    return TorchRunner(model.eval()), "torch"


def step_health(job_dir: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """Score the staged and the active model on the same held-out device data."""
    import numpy as np

    from exporters.runtime import batch_of, measure_latency, predict

    opts = ctx["spec"]["health"]
    x, y = _held_out(ctx, opts["samples"])
    out: dict[str, Any] = {"samples": len(x), "tensorrt": "skipped: no TensorRT on this host"}
    roles = ("active", "staged") if ctx.get("active_path") else ("staged",)
    failures = []
    for role in roles:
        runner, runtime = _runner(Path(ctx[f"{role}_path"]))
        logits = predict(runner, x)
        acc = float((logits.argmax(1) == y).mean()) if y is not None else None
        lat = measure_latency(runner, batch_of(x, 1), warmup=5, iters=50)
        out[role] = {"accuracy": acc, "p50_ms_b1": lat.p50_ms, "runtime": runtime}
        if role == "staged" and not np.isfinite(logits).all():
            failures.append("the staged model gives non-finite outputs")
    if y is None or "active" not in out:
        out["passed"], out["failures"] = not failures, failures
        return out
    a, s = out["active"], out["staged"]
    drop = 100 * (a["accuracy"] - s["accuracy"])
    if drop > opts["max_accuracy_drop_pts"]:
        failures.append(f"accuracy {100 * s['accuracy']:.1f}% is {drop:.1f} points below the "
                        f"active model's {100 * a['accuracy']:.1f}% "
                        f"(health.max_accuracy_drop_pts={opts['max_accuracy_drop_pts']})")
    if opts["min_accuracy"] is not None and s["accuracy"] < opts["min_accuracy"]:
        failures.append(f"accuracy {100 * s['accuracy']:.1f}% is below health.min_accuracy="
                        f"{opts['min_accuracy']}")
    ratio = s["p50_ms_b1"] / max(a["p50_ms_b1"], 1e-9)
    if opts["max_latency_ratio"] is not None and ratio > opts["max_latency_ratio"]:
        failures.append(f"latency p50 {s['p50_ms_b1']:.2f} ms is {ratio:.2f}x the active "
                        f"model's (health.max_latency_ratio={opts['max_latency_ratio']})")
    out["latency_ratio"] = round(float(np.float64(ratio)), 3)
    out["passed"], out["failures"] = not failures, failures
    return out


def step_stage(job_dir: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """Sign the fine-tuned model with the device key and assemble it into the standby slot
    (``current`` is not touched); verified against the trusted keys like any pulled version."""
    from agent.storage.slots import read_installed
    from agent.storage.trust import load_trusted
    from agent.storage.update import stage_local
    from hpc_core.model_spec import read_checkpoint
    from registry.publish import collect_artefacts
    from registry.signing import load_signing_key
    from registry.upload import default_version

    state_dir = Path(ctx["state_dir"])
    key = load_signing_key(Path(ctx["signing_key"]))
    # The upstream as pull left it (a slot, or the job's copy of a fetched version).
    parent = read_installed(Path(ctx["upstream_path"]), "upstream")
    if parent is None:
        raise RuntimeError(f"the upstream {ctx['upstream_path']} is incomplete")
    # The version name is fixed once, so a restarted stage rebuilds the very same version.
    vfile = job_dir / "stage_version.txt"
    if not vfile.is_file():
        write_bytes_atomic(vfile, default_version(parent.version, key.name).encode())
    _crash_inside("stage")  # the version is fixed, nothing is staged yet
    staged = stage_local(
        read_checkpoint(Path(ctx["finetuned"])), state_dir=state_dir, parent=parent,
        version=vfile.read_text().strip(), key=key,
        trusted=load_trusted(Path(ctx["trusted_keys"])),
        artefacts=collect_artefacts([Path(a) for a in ctx.get("artefacts") or []]),
    )
    return {"version": staged.version, "slot": staged.slot,
            "sequence": staged.manifest.sequence, "signer": key.name}


def step_fetch(job_dir: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """Pull a registry version (manifest verified before any chunk, every chunk hashed).

    A deploy stages it into the standby slot (the active model is not touched; the sequence
    must not be below the highest installed). A fine-tune only trains from it: it goes to
    JOB_DIR/upstream and never into a slot, so it can never be committed and an older
    upstream than the device's newest fine-tune is accepted (``fetch_training_source``)."""
    from agent.storage.chunk_store import ChunkStore
    from agent.storage.slots import ModelSlots
    from agent.storage.trust import load_trusted
    from agent.storage.update import fetch_training_source, pull
    from registry.refs import Ref

    spec, state_dir = ctx["spec"], Path(ctx["state_dir"])
    ref = Ref(spec["model"], spec["version"], spec["registry"])
    trusted = load_trusted(Path(ctx["trusted_keys"]))
    if "finetune" in spec:
        pulled, source = fetch_training_source(ref, job_dir / "upstream", state_dir=state_dir,
                                               trusted=trusted)
        return {"version": source.version, "path": str(source.path), "slot": source.slot,
                "sequence": source.manifest.sequence, "fetched": True, "training_source": True,
                "chunks_fetched": pulled.chunks_fetched, "bytes_fetched": pulled.bytes_fetched}
    pulled = pull(ref, state_dir=state_dir, trusted=trusted)
    v, slots = pulled.verified, ModelSlots(state_dir, ref.name)
    active = slots.active()
    if active is not None and active.version == ref.version:
        staged = active
    else:
        staged = slots.stage(v.manifest, v.manifest_bytes, v.signature_bytes,
                             ChunkStore(state_dir), v.key)
    return {"version": staged.version, "path": str(staged.path), "slot": staged.slot,
            "sequence": staged.manifest.sequence, "fetched": True,
            "chunks_fetched": pulled.chunks_fetched, "bytes_fetched": pulled.bytes_fetched}


STEPS = {"fetch": step_fetch, "config": step_config, "finetune": step_finetune,
         "export": step_export, "stage": step_stage, "health": step_health}


def main(argv: list[str]) -> int:
    step, job_dir = argv[0], Path(argv[1])
    from agent.jobs.worker import die_with_parent

    die_with_parent()
    ctx = _context(job_dir)
    out = STEPS[step](job_dir, ctx)
    write_json_atomic(job_dir / f"{step}.json", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
