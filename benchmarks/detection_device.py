"""Detection, device half: an upstream detector fine-tuned by the device job on a device's
camera-shifted images at 320 px, under the Jetson Orin Nano 8 GB profile's memory budget.

:func:`device_fine_tune` (what ``benchmarks/detection.py`` calls with its upstream checkpoint)
runs the whole device job through its worker, as a device does: the checkpoint published
signed to a local registry as ``det@v1``; the device's set written by the synthetic generator
through its camera (``scripts/make_detection_data.py --camera rotate``: images the upstream
never saw, from a camera mounted 90 degrees off, the shift that costs the CPU recipe most of
its mAP); pull, the memory planner's probes (list batches of the detector at three
micro-batch sizes) and its plan, the fine-tune paced by the board's governor (its simulated
sensors), stage, health by mAP against the upstream on the device's held-out images, then
commit or rollback. No export: a detector has none yet.

Reported: the planned micro-batch, the whole process tree's peak the plan predicted beside the
one the job measured (worker + probes + fine-tune child, PSS) and the highest of every step,
against the profile's budget; optimizer steps per second (the governor's wall time, pauses
included); COCO mAP@0.5 (and mAP@0.5:0.95) of the upstream and of the fine-tuned model on the
same held-out device images.

Target: mAP@0.5 on the device's images up by at least 10 points (``benchmarks/detection.py``
prints the verdict: it trains the upstream this half starts from, in the same run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.harness import fmt  # noqa: E402

if TYPE_CHECKING:
    from hpc_core.tasks.detection.synthetic import Scenes

PROFILE = "jetson-orin-nano-8gb"
MODEL = "det"


@dataclass(frozen=True)
class DeviceFineTune:
    """What one device job measured (fractions for mAP, MB for memory)."""

    outcome: str
    """committed | rolled_back (the health check by mAP@0.5:0.95 decides)."""
    size: int
    profile: str
    budget_mb: float
    micro_batch: int
    accumulation: int
    probes: dict[str, list[float]]
    """The planner's probe peaks (MB) by micro-batch size."""
    predicted_peak_mb: float
    """The plan's predicted whole-tree peak of the fine-tune (worker + training child)."""
    finetune_peak_mb: float
    """The fine-tune step's measured whole-tree peak (worker, probes, child; PSS)."""
    job_peak_mb: float
    peak_step: str
    steps: int
    steps_per_s: float
    train_images: int
    held_out_images: int
    map50_before: float
    map50_after: float
    map_before: float
    map_after: float
    job_s: float

    @property
    def gain_pts(self) -> float:
        return 100.0 * (self.map50_after - self.map50_before)


def _device_set(out: Path, images: int, size: int, seed: int, cameras: Sequence[str],
                scenes: Scenes | None) -> Path:
    from hpc_core.tasks.detection.synthetic import DEFAULT_SCENES, write_synthetic

    return write_synthetic(out, images, size, seed, list(cameras), ["coco"],
                           scenes or DEFAULT_SCENES)


def _device(work: Path, checkpoint: Path) -> tuple[Path, Path]:
    """A device state dir with its keys, and a registry folder holding ``det@v1``: the
    upstream checkpoint, signed by an upstream key the device trusts."""
    from hpc_core.model_spec import read_checkpoint
    from registry.publish import publish_content
    from registry.signing import generate_keypair, load_signing_key
    from registry.stores import LocalStore

    state, registry = work / "state", work / "registry"
    up_priv, up_pub = generate_keypair(work / "keys", "upstream")
    (state / "trusted_keys").mkdir(parents=True)
    _, dev_pub = generate_keypair(state, "device")
    for p in (up_pub, dev_pub):
        (state / "trusted_keys" / p.name).write_bytes(p.read_bytes())
    publish_content(read_checkpoint(checkpoint), LocalStore(registry), name=MODEL,
                    version="v1", key=load_signing_key(up_priv))
    return state, registry


def device_fine_tune(checkpoint: Path, work: Path, *, size: int = 320, images: int = 96,
                     steps: int = 40, effective_batch: int = 16, lr: float = 0.001,
                     cameras: Sequence[str] = ("rotate",), seed: int = 1,
                     scenes: Scenes | None = None,
                     profile: str = PROFILE, val_fraction: float = 0.25,
                     threads: int | None = None) -> DeviceFineTune:
    """Fine-tune the detector at ``checkpoint`` with the device job on ``images`` synthetic
    images of ``size`` px seen through ``cameras`` (``seed``: other images than upstream's),
    under ``profile``'s budget, and return what it measured. ``work``: an empty folder for
    the device, its registry and its data. ``threads``: torch threads of the job's children
    (default: one, as the job runs them)."""
    from agent.jobs.spec import DeviceJob
    from agent.jobs.store import JobState, JobStore

    work.mkdir(parents=True, exist_ok=True)
    data = _device_set(work / "cam0", images, size, seed, cameras, scenes)
    state, registry = _device(work, checkpoint)
    spec = DeviceJob.model_validate({
        "model": MODEL, "version": "v1", "registry": str(registry), "data": str(data),
        "finetune": {"profile": profile, "sensors": "sim", "trainable": "all",
                     "steps": steps, "effective_batch": effective_batch, "micro_batch": None,
                     "lr": lr, "checkpoint_every": max(steps, 1), "val_fraction": val_fraction},
        "steps": {"export": False}})
    store = JobStore(state)
    store.submit("bench", "finetune", spec.model_dump(mode="json"))
    store.close()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "agent.jobs.worker", "--state-dir", str(state),
                           "--job-id", "bench", "--no-parent-check"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
    job_s = time.perf_counter() - t0
    store = JobStore(state)
    rec, outs = store.get("bench"), {s.name: s.outputs or {} for s in store.steps("bench")}
    store.close()
    if done.returncode != 0 or rec is None or rec.state not in (JobState.SUCCEEDED,
                                                                JobState.FAILED):
        raise RuntimeError(f"the device job ended {getattr(rec, 'state', None)} (worker exit "
                           f"{done.returncode}): {done.stderr[-2000:]}")
    if "health" not in outs:
        raise RuntimeError(f"the device job failed before its health check: {rec.error}")
    return _figures(rec.result, outs, size, profile, job_s)


def _figures(res: dict[str, Any], outs: dict[str, dict[str, Any]], size: int, profile: str,
             job_s: float) -> DeviceFineTune:
    health, ft, mem = outs["health"], outs["finetune"], res["memory"]
    plan = ft["memory"]["plan"]
    gov = ft.get("governor") or {}
    elapsed = gov.get("elapsed_s") or float("nan")
    return DeviceFineTune(
        outcome=res["outcome"], size=size, profile=profile, budget_mb=mem["budget_mb"],
        micro_batch=plan["micro_batch_size"], accumulation=plan["accumulation_steps"],
        probes=plan["probes"], predicted_peak_mb=plan["predicted_tree_peak_mb"],
        finetune_peak_mb=mem["steps_peak_mb"]["finetune"], job_peak_mb=mem["peak_tree_mb"],
        peak_step=mem["peak_step"], steps=ft["steps"], steps_per_s=ft["steps"] / elapsed,
        train_images=ft["train_samples"], held_out_images=health["samples"],
        map50_before=_nan(health["active"]["metrics"]["map50"]),
        map50_after=_nan(health["staged"]["metrics"]["map50"]),
        map_before=health["active"]["metric"], map_after=health["staged"]["metric"],
        job_s=job_s)


def _nan(v: float | None) -> float:
    return float("nan") if v is None else float(v)


def report_lines(r: DeviceFineTune) -> list[str]:
    """The device half's figures as a Markdown table."""
    return [
        f"## device fine-tune: {r.train_images} camera-shifted images at {r.size} px, "
        f"{r.profile} budget {fmt(r.budget_mb)} MB",
        "| what | figure |", "|---|---|",
        f"| memory plan | micro-batch {r.micro_batch} x {r.accumulation} accumulation; probes "
        f"(MB) {json.dumps(r.probes)} |",
        f"| whole-tree peak, fine-tune: predicted -> measured | {fmt(r.predicted_peak_mb)} -> "
        f"{fmt(r.finetune_peak_mb)} MB ({fmt(r.finetune_peak_mb / r.budget_mb)} of the "
        "budget) |",
        f"| whole-tree peak, whole job | {fmt(r.job_peak_mb)} MB in {r.peak_step} |",
        f"| fine-tune | {r.steps} steps, {fmt(r.steps_per_s)} steps/s (governor wall time) |",
        f"| mAP@0.5 on {r.held_out_images} held-out device images: upstream -> fine-tuned | "
        f"{fmt(r.map50_before)} -> {fmt(r.map50_after)} ({r.gain_pts:+.1f} pts) |",
        f"| mAP@0.5:0.95 (the health gate's) | {fmt(r.map_before)} -> {fmt(r.map_after)}: "
        f"{r.outcome} |",
        f"| whole job (pull .. commit) | {fmt(r.job_s)} s |",
    ]
