"""The device job's steps, one small function each (see ``agent.jobs.machine`` for the order).

These run in the torch-free worker; the steps that need torch (fine-tune, export, staging,
health) run ``python -m agent.jobs.child`` so that only one torch process is alive at a time
and the memory budget covers the whole tree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from agent.finetune.memory_plan import BudgetTooSmall, plan_micro_batch
from agent.jobs.child import CONTEXT
from agent.jobs.launch import python_argv
from agent.jobs.machine import (
    CRASH_ENV,
    Canceled,
    JobContext,
    StepFailed,
    Suspended,
    TimedOut,
    crash_point,
    model_name,
)
from agent.jobs.proctree import TreePeak, rss_mb
from agent.jobs.spec import DeployJob
from hpc_core.atomic import write_json_atomic
from hpc_core.config import config_from_dict

SIGTERM_SEEN = {"flag": False}
"""Set by the worker's SIGTERM handler; the child wait loop forwards it and suspends."""


def trusted_dir(ctx: JobContext) -> Path:
    return ctx.spec.trusted_keys or ctx.state_dir / "trusted_keys"


def trusted_keys(ctx: JobContext) -> Any:
    """The job's trusted keys, checked on disk first (``agent.storage.trust``)."""
    from agent.storage.trust import load_trusted

    return load_trusted(trusted_dir(ctx))


def signing_key_path(ctx: JobContext) -> Path:
    return getattr(ctx.spec, "signing_key", None) or ctx.state_dir / "device.key.pem"


def export_artefacts(outputs: dict[str, Any]) -> list[str]:
    """The files the export step installed (a job exported before model.onnx.json existed
    recorded only ``artefact``)."""
    ex = outputs.get("export", {})
    return list(ex.get("artefacts") or ([ex["artefact"]] if ex.get("artefact") else []))


def _write_context(ctx: JobContext, **extra: Any) -> None:
    o = ctx.outputs
    data = {
        "job_id": ctx.job_id, "state_dir": str(ctx.state_dir), "job_dir": str(ctx.job_dir),
        "spec": ctx.spec.model_dump(mode="json"),
        "upstream_path": o.get("pull", {}).get("path"),
        "upstream_version": o.get("pull", {}).get("version"),
        "finetuned": o.get("finetune", {}).get("checkpoint"),
        "artefacts": export_artefacts(o),
        "train_config": _read(ctx.job_dir / "config.json").get("config"),
        "signing_key": str(signing_key_path(ctx)),
        "trusted_keys": str(trusted_dir(ctx)),
        **extra,
    }
    write_json_atomic(ctx.job_dir / CONTEXT, data)


HEARTBEAT_S = 5.0
"""A running child step is reported this often, with the last line of its log."""


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 400))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][-160:] if lines else ""


def _child_under_way(ctx: JobContext, step: str, elapsed: float) -> bool:
    """Fault injection: the child is well inside its work (the fine-tune past a checkpoint).
    The stage takes a fraction of a second: its child kills the job itself (child.py)."""
    if step == "stage":
        return False
    if step == "finetune":
        prog = ctx.store.get(ctx.job_id).progress or {}  # type: ignore[union-attr]
        every = ctx.spec.finetune.checkpoint_every
        return prog.get("stage") == "finetune" and prog.get("step", 0) >= every + every // 2
    return elapsed >= 1.5


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def run_child(ctx: JobContext, step: str, *, cancel_inside: bool = False) -> dict[str, Any]:
    """Run one torch step in a child process and return what it wrote."""
    out = ctx.job_dir / f"{step}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(ctx.job_dir / f"{step}.log", "ab")  # noqa: SIM115 - closed below
    try:
        # The working directory (a user's shell, for agentctl) never shadows a module.
        p = subprocess.Popen(python_argv("agent.jobs.child", step, str(ctx.job_dir.absolute())),
                             stdout=log, stderr=log, env=env)
        forwarded, t0, beat = False, time.monotonic(), time.monotonic()
        inside = f"inside:{ctx.current}" in os.environ.get(CRASH_ENV, "").split(",")
        while p.poll() is None:
            if inside and _child_under_way(ctx, step, time.monotonic() - t0):
                crash_point(f"inside:{ctx.current}")
            if time.monotonic() - beat >= HEARTBEAT_S:  # long exports: never minutes of silence
                beat = time.monotonic()
                ctx.event(step, publish=step != "finetune", status="running",
                          elapsed_s=round(beat - t0), last=_last_line(ctx.job_dir / f"{step}.log"))
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
    """The upstream version, verified: signature against the trusted keys, every tensor's hash.

    Installed: re-verified in place; a fine-tune's upstream in the standby slot is first
    copied into the job folder (the stage step replaces that slot). Not on the device:
    fetched from the job's registry in a child (``fetch``): a deploy stages it into the
    standby slot (the active model stays, a lower sequence is refused); a fine-tune only
    trains from it, so it goes into the job folder, never a slot, and may be older than the
    newest version installed (what the job commits is its own new, higher version)."""
    from agent.storage.lock import StateLock
    from agent.storage.slots import ModelSlots, read_installed
    from agent.storage.verify import verify_slot
    from registry.errors import RegistryError

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    active = slots.active()
    try:
        base = slots.installed(ctx.spec.version) if active is not None else None
    except RegistryError:
        base = None
    if base is None or (isinstance(ctx.spec, DeployJob) and base.slot != getattr(active, "slot",
                                                                                None)):
        if ctx.spec.version is None:
            raise StepFailed("pull", f"no model {ctx.spec.model!r} is installed: give --version "
                             "and --registry to fetch one", code="NOT_FOUND")
        if not ctx.spec.registry:
            raise StepFailed("pull", f"{ctx.spec.model}@{ctx.spec.version} is not on this "
                             "device and the job has no registry to fetch it from: set "
                             "registry.url in agent.yaml (agentctl: --registry)",
                             code="NOT_FOUND")
        _write_context(ctx)
        out = run_child(ctx, "fetch")
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


def finetune(ctx: JobContext) -> dict[str, Any]:
    plan_file = ctx.job_dir / "plan.json"
    _write_context(ctx)
    config_file = ctx.job_dir / "config.json"
    with TreePeak() as peak:
        ft = ctx.spec.finetune
        plan = _read(plan_file) or None
        if plan is None and ft.micro_batch is None:  # type: ignore[attr-defined]
            # The planner probes the training config: a child builds it first. With the
            # micro-batch given, the fine-tune child writes it itself (one torch start less).
            if not config_file.is_file():
                write_json_atomic(config_file, run_child(ctx, "config"))
            cfg = _read(config_file)
            ctx.event("finetune", status="planning", budget_mb=cfg["budget_mb"])
            train_cfg = config_from_dict(cfg["config"])
            train_cfg = train_cfg.model_copy(update={"run": train_cfg.run.model_copy(
                update={"output_dir": ctx.job_dir / "probes"})})
            try:
                plan = plan_micro_batch(
                    train_cfg, Path(ctx.outputs["pull"]["path"]),
                    ft.trainable, cfg["budget_mb"],  # type: ignore[attr-defined]
                    job_process_mb=rss_mb(os.getpid()),
                    cache=ctx.state_dir / "cache" / "memory_probes.json").to_dict()
            except BudgetTooSmall as e:  # the job's answer, not a crash to retry
                raise StepFailed("finetune", str(e)) from None
            write_json_atomic(plan_file, plan)
        _write_context(ctx, plan=plan)
        ctx.event("finetune", status="training", plan=plan)
        out = run_child(ctx, "finetune", cancel_inside=True)
    cfg = _read(config_file)
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
    """Sign the fine-tuned model with the device key and assemble it into the standby slot;
    a deploy stages the pulled registry version (already there when pull fetched it)."""
    _write_context(ctx)
    if isinstance(ctx.spec, DeployJob):
        pulled = ctx.outputs["pull"]
        if pulled.get("fetched"):
            return {"version": pulled["version"], "slot": pulled["slot"],
                    "sequence": pulled["sequence"]}
        return run_child(ctx, "fetch")  # the version is active already: nothing new to stage
    return run_child(ctx, "stage")


def health(ctx: JobContext) -> dict[str, Any]:
    from agent.storage.slots import ModelSlots

    slots = ModelSlots(ctx.state_dir, ctx.spec.model)
    active, staged = slots.active(), slots.standby()
    if staged is None or staged.version != ctx.outputs["stage"]["version"]:
        raise StepFailed("health", "the staged version is not in the standby slot")
    # A device with no active model yet compares against the upstream it started from.
    reference = active.path if active is not None else ctx.outputs["pull"].get("path")
    _write_context(ctx, active_path=str(reference) if reference else None,
                   staged_path=str(staged.path))
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
    """Publish the committed model, signed by this device, as a child of the upstream.

    Idempotent: a re-run after a crash that finds the version in the registry accepts it when
    it is signed by this device's key, has the same parent and the very same tensors (the
    upload finished before the crash); anything else there is a conflict."""
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
    from registry.pull import fetch_verified_manifest
    from registry.refs import Ref
    from registry.stores import open_store
    from registry.transfer import TransferConfig

    cfg = TransferConfig()
    ref = Ref(ctx.spec.model, version, target)
    got = fetch_verified_manifest(open_store(target, cfg), ref, trusted_keys(ctx),
                                  cfg).manifest
    from agent.storage.slots import ModelSlots

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


def switch(ctx: JobContext) -> dict[str, Any]:
    """The rollback job: the verified standby version becomes active again."""
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    name = model_name(ctx)
    slots = ModelSlots(ctx.state_dir, name)
    trusted = trusted_keys(ctx)  # a bad trusted-keys folder fails the job as itself
    try:
        res = slots.rollback(trusted)
    except RegistryError as e:
        raise StepFailed("switch", str(e), code="NOT_FOUND") from None
    return {"version": res.active.version, "slot": res.active.slot,
            "previous": res.previous.version if res.previous else None}


STEPS = {"pull": pull, "finetune": finetune, "export": export, "stage": stage,
         "health": health, "commit": commit, "rollback": rollback, "upload": upload,
         "switch": switch}
