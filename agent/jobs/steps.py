"""The device job's steps, one small function each (see ``agent.jobs.machine`` for the order).

These run in the torch-free worker; the steps that need torch (fine-tune, export, staging,
health) run ``python -m agent.jobs.child`` so that only one torch process is alive at a time
and the memory budget covers the whole tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.jobs.budget import plan_for_tree
from agent.jobs.child import CONTEXT
from agent.jobs.machine import Canceled, JobContext, StepFailed, Suspended, TimedOut
from agent.jobs.proctree import TreePeak
from hpc_core.atomic import write_json_atomic

SIGTERM_SEEN = {"flag": False}
"""Set by the worker's SIGTERM handler; the child wait loop forwards it and suspends."""


def trusted_dir(ctx: JobContext) -> Path:
    return ctx.spec.trusted_keys or ctx.state_dir / "trusted_keys"


def signing_key_path(ctx: JobContext) -> Path:
    return ctx.spec.signing_key or ctx.state_dir / "device.key.pem"


def _write_context(ctx: JobContext, **extra: Any) -> None:
    o = ctx.outputs
    data = {
        "job_id": ctx.job_id, "state_dir": str(ctx.state_dir), "job_dir": str(ctx.job_dir),
        "spec": ctx.spec.model_dump(mode="json"),
        "upstream_path": o.get("pull", {}).get("path"),
        "upstream_version": o.get("pull", {}).get("version"),
        "finetuned": o.get("finetune", {}).get("checkpoint"),
        "artefact": o.get("export", {}).get("artefact"),
        "train_config": _read(ctx.job_dir / "config.json").get("config"),
        "signing_key": str(signing_key_path(ctx)),
        "trusted_keys": str(trusted_dir(ctx)),
        **extra,
    }
    write_json_atomic(ctx.job_dir / CONTEXT, data)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def run_child(ctx: JobContext, step: str, *, cancel_inside: bool = False) -> dict[str, Any]:
    """Run one torch step in a child process and return what it wrote."""
    out = ctx.job_dir / f"{step}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(ctx.job_dir / f"{step}.log", "ab")  # noqa: SIM115 - closed below
    try:
        p = subprocess.Popen([sys.executable, "-m", "agent.jobs.child", step, str(ctx.job_dir)],
                             stdout=log, stderr=log, env=env)
        forwarded = False
        while p.poll() is None:
            if SIGTERM_SEEN["flag"] and not forwarded:
                p.send_signal(signal.SIGTERM)  # the trainer checkpoints at its next step
                forwarded = True
            if ctx.deadline is not None and time.time() > ctx.deadline:
                p.kill()
                p.wait()
                raise TimedOut(f"timeout_s passed during {step}")
            time.sleep(0.05)
    finally:
        log.close()
    if SIGTERM_SEEN["flag"]:
        raise Suspended(step)
    if p.returncode != 0:
        tail = (ctx.job_dir / f"{step}.log").read_text(errors="replace")[-1500:]
        raise StepFailed(step, f"exited with {p.returncode}: {tail.strip().splitlines()[-1:]}",
                         code="INTERNAL")
    return _read(out)


# -- the steps ---------------------------------------------------------------------------------


def pull(ctx: JobContext) -> dict[str, Any]:
    """Verify the upstream version: signature against the trusted keys, every tensor's hash."""
    from agent.storage.slots import ModelSlots
    from agent.storage.verify import verify_slot
    from registry.signing import load_trusted_keys

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    try:
        base = slots.installed(ctx.spec.version)
        verify_slot(base.path, load_trusted_keys(trusted_dir(ctx)))
    except Exception as e:
        raise StepFailed("pull", str(e)) from None
    return {"version": base.version, "path": str(base.path), "slot": base.slot,
            "sequence": base.manifest.sequence}


def finetune(ctx: JobContext) -> dict[str, Any]:
    plan_file = ctx.job_dir / "plan.json"
    _write_context(ctx)
    with TreePeak() as peak:
        if not (ctx.job_dir / "config.json").is_file():
            cfg = run_child(ctx, "config")
            write_json_atomic(ctx.job_dir / "config.json", cfg)
        cfg = _read(ctx.job_dir / "config.json")
        ft = ctx.spec.finetune
        plan = _read(plan_file) or None
        if plan is None and ft.micro_batch is None:  # type: ignore[attr-defined]
            ctx.event("finetune", status="planning", budget_mb=cfg["budget_mb"])
            plan = plan_for_tree(cfg, Path(ctx.outputs["pull"]["path"]),
                                 ft.trainable, cfg["budget_mb"],  # type: ignore[attr-defined]
                                 ctx.job_dir / "probes")
            write_json_atomic(plan_file, plan)
        _write_context(ctx, plan=plan)
        ctx.event("finetune", status="training", plan=plan)
        out = run_child(ctx, "finetune", cancel_inside=True)
    if str(out.get("stopped_reason", "")).endswith("cancel"):
        raise Canceled("canceled during finetune")
    out["memory"] = {"budget_mb": cfg["budget_mb"], "tree_peak_mb": round(peak.peak_mb, 1),
                     "plan": plan}
    return out


def export(ctx: JobContext) -> dict[str, Any]:
    _write_context(ctx)
    out = run_child(ctx, "export")
    if out.get("status") != "passed":
        raise StepFailed("export", f"no export step met the gates: {out.get('fallback_reason')}")
    return out


def stage(ctx: JobContext) -> dict[str, Any]:
    """Sign the fine-tuned model with the device key and assemble it into the standby slot."""
    _write_context(ctx)
    return run_child(ctx, "stage")


def health(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    active, staged = slots.active(), slots.standby()
    if active is None or staged is None or staged.version != ctx.outputs["stage"]["version"]:
        raise StepFailed("health", "the staged version is not in the standby slot")
    _write_context(ctx, active_path=str(active.path), staged_path=str(staged.path))
    return run_child(ctx, "health")


def commit(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    version = ctx.outputs["stage"]["version"]
    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    active = slots.active()
    if active is None or active.version != version:  # a resumed commit already switched
        slots.commit(version)
        active = slots.active()
    assert active is not None
    return {"version": active.version, "slot": active.slot}


def rollback(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    staged = slots.standby()
    staged_version = ctx.outputs.get("stage", {}).get("version")
    if staged is not None and staged.version == staged_version:
        slots.discard_staged()
    active = slots.active()
    return {"why": "; ".join(ctx.outputs.get("health", {}).get("failures", [])) or "job ended",
            "active": active.version if active else None}


def upload(ctx: JobContext) -> dict[str, Any]:
    from registry.signing import load_signing_key
    from registry.upload import upload as publish

    target = ctx.spec.upload.registry or ctx.spec.registry
    artefacts = [Path(a) for a in [ctx.outputs.get("export", {}).get("artefact")] if a]
    health_out = ctx.outputs["health"]
    report = publish(
        Path(ctx.outputs["finetune"]["checkpoint"]), state_dir=ctx.state_dir,
        name=ctx.spec.model, target=str(target), key=load_signing_key(signing_key_path(ctx)),
        version=ctx.spec.upload.version or ctx.outputs["stage"]["version"],
        parent=ctx.outputs["pull"]["version"], artefacts=artefacts,
        metrics={"device/acc": health_out["staged"]["accuracy"]},
    )
    m = report.manifest
    return {"version": m.version, "parent": m.parent, "sequence": m.sequence, "uri": report.uri}


STEPS = {"pull": pull, "finetune": finetune, "export": export, "stage": stage,
         "health": health, "commit": commit, "rollback": rollback, "upload": upload}
