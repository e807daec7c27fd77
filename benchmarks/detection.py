"""Detection, both halves in one run: configs/detection_cpu.yaml trained upstream on this
machine's CPU, then fine-tuned by the device job on a device's camera-shifted images.

Upstream half: the config as it stands (SSDlite on a half-width MobileNetV3-Large, from
scratch, 320 px, on the synthetic set) trains for its whole schedule (``training.max_steps``,
the cosine decay included), capped at ``--budget-s`` of wall time: a trainer hook stops it at
the first step boundary past the cap (``Trainer.request_stop``: it checkpoints and evaluates
like a preempted run), and the report says when the cap cut the schedule short. Then the
final evaluation on the held-out images. Reported: COCO's mAP@0.5 and mAP@0.5:0.95
(pycocotools), optimizer steps and images per second, the process's CPU time beside the wall
time (the host may be shared: its load average is printed at the start and the end), the loss
at the start and at the end.

Threads: ``--threads auto`` (the default) gives torch the cores the load average leaves free,
at least one. OpenMP threads that lose their core to another process stall the others at
every barrier: on 2 shared cores at load 7, a 320 px step of batch 16 took 8.8 s with 2
threads and 2.5 s with 1; on the same cores idle, 1.1 s with 2 and 1.8 s with 1.

Device half (:mod:`benchmarks.detection_device`): that checkpoint, published signed, pulled
by a device's job and fine-tuned at the same size on the device's own images (another seed,
seen through ``--camera``, rotate by default: a camera mounted 90 degrees off) under the
Jetson Orin Nano 8 GB profile's memory budget, the planner choosing the micro-batch; its
health step scores the upstream and the fine-tuned model on the device's held-out images.

Target: the device fine-tune raises mAP@0.5 on the device's held-out images by at least 10
points. Also: the upstream reaches mAP@0.5 >= 0.5 on the held-out split of the clean set (the
detector finds most objects with the right class, what a device fine-tune needs to start
from), its training loss falls to at most 0.85 of where it started (mean of the last three
steps against the first three), its schedule ends inside the budget, and the device job's
whole process tree peaks within 1.05 x its budget.

    python benchmarks/detection.py [--config configs/detection_cpu.yaml] [--budget-s 300]
        [--threads auto|N] [--steps N]
        [--camera rotate] [--device-images 96] [--device-steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.detection_device import (  # noqa: E402
    DeviceFineTune,
    device_fine_tune,
    report_lines,
)
from benchmarks.harness import fmt, parse_args, verdict  # noqa: E402
from exporters.cpu_isa import detect_isa  # noqa: E402
from hpc_core.config import TrainConfig, load_config  # noqa: E402
from hpc_core.metrics import read_metrics  # noqa: E402
from hpc_core.tasks.detection.synthetic import Scenes  # noqa: E402
from hpc_core.tasks.detection.synthetic_config import (  # noqa: E402
    CameraKind,
    SyntheticClass,
    SyntheticDetectionConfig,
)
from hpc_core.trainer import Trainer  # noqa: E402

CONFIG = REPO / "configs/detection_cpu.yaml"
TARGET_MAP50 = 0.5
TARGET_GAIN_PTS = 10.0
"""mAP@0.5 on the device's held-out images, fine-tuned minus upstream, in points."""
TARGET_LOSS_RATIO = 0.85
LOSS_WINDOW = 3
"""Steps averaged at each end of the run for the loss ratio (one step's loss is noisy)."""


@dataclass(frozen=True)
class UpstreamResult:
    """What the upstream half measured, and where its checkpoint is (for the device half)."""

    checkpoint: Path
    steps: int
    scheduled_steps: int
    train_s: float
    """Wall time of the optimizer steps and checkpoints (set-up, drawing the set and the
    evaluations excluded)."""
    cpu_s: float
    """The process's CPU time (all its threads) over the same span."""
    global_batch: int
    metrics: dict[str, float]
    first_loss: float
    """Mean train/loss of the first LOSS_WINDOW steps."""
    last_loss: float
    """... and of the last LOSS_WINDOW steps."""
    data_s: float
    """Drawing the synthetic set (in memory) and building the model."""
    evals: int
    eval_s: float
    """Wall time of the evaluations (those the config asks for on the way, and the final
    one)."""
    eval_cpu_s: float
    val_images: int

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.train_s if self.train_s > 0 else math.nan

    @property
    def cut(self) -> bool:
        """The budget stopped the run before its schedule ended."""
        return self.steps < self.scheduled_steps


class TimeBudget:
    """A trainer hook: stop at the first step boundary past ``budget_s`` of training (the
    evaluations on the way included)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.t0: float | None = None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        assert self.t0 is not None
        if time.perf_counter() - self.t0 >= self.budget_s:
            trainer.request_stop(f"time budget {self.budget_s:g} s")


class EvalTimer:
    """Wraps a trainer's ``evaluate``: how many ran, their wall and CPU time."""

    def __init__(self, trainer: Trainer) -> None:
        self.calls, self.wall, self.cpu = 0, 0.0, 0.0
        inner = trainer.evaluate

        def timed() -> dict[str, float]:
            w, c = time.perf_counter(), time.process_time()
            try:
                return inner()
            finally:
                self.calls += 1
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c

        trainer.evaluate = timed  # type: ignore[method-assign]


def upstream_config(out: Path, args: argparse.Namespace) -> TrainConfig:
    """The config (``--config``), with only what the command line changes: the output folder,
    a loss logged every step, and any of --images, --size, --batch, --steps given."""
    sets = [f"run.output_dir={out}", "logging.progress=off", "logging.log_every_steps=1"]
    cfg = load_config(args.config)
    synthetic = cfg.data.synthetic.model_dump(mode="json") if cfg.data.synthetic else {}
    if args.images is not None:
        synthetic["images"] = args.images
    if args.size is not None:
        synthetic["size"] = args.size
        sets.append(f"data.image_size={args.size}")
    if synthetic:
        sets.append(f"data.synthetic={json.dumps(synthetic)}")  # JSON is YAML
    if args.batch is not None:
        sets.append(f"training.global_batch_size={args.batch}")
    if args.steps is not None:
        sets += ["training.epochs=null", f"training.max_steps={args.steps}"]
    return load_config(args.config, sets)


def train_upstream(cfg: TrainConfig, budget_s: float) -> UpstreamResult:
    """Train ``cfg`` for its schedule or ``budget_s`` seconds, whichever ends first;
    evaluated at the end."""
    budget = TimeBudget(budget_s)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, hooks=[budget])
    evals = EvalTimer(trainer)
    data_s = time.perf_counter() - t0
    budget.start()
    cpu0 = time.process_time()
    result = trainer.train()
    total_s = time.perf_counter() - budget.t0  # type: ignore[operator]
    total_cpu = time.process_time() - cpu0
    out = cfg.run.output_dir
    losses = [m["train/loss"] for m in read_metrics(out / "metrics.jsonl") if "train/loss" in m]
    return UpstreamResult(
        checkpoint=out / "checkpoints", steps=result.final_step,
        scheduled_steps=trainer.total_steps, train_s=total_s - evals.wall,
        cpu_s=total_cpu - evals.cpu, global_batch=cfg.training.global_batch_size,
        metrics=result.metrics, first_loss=_mean(losses[:LOSS_WINDOW]),
        last_loss=_mean(losses[-LOSS_WINDOW:]), data_s=data_s, evals=evals.calls,
        eval_s=evals.wall, eval_cpu_s=evals.cpu,
        val_images=len(trainer.val_ds))  # type: ignore[arg-type]


def _shown(path: Path) -> str:
    """A config's path as the user would type it: relative to the repository when inside."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def finetune_on_device(cfg: TrainConfig, upstream: Path, work: Path,
                       args: argparse.Namespace) -> DeviceFineTune:
    """The device half: ``upstream`` (a checkpoint of ``cfg``) fine-tuned by the device job on
    a device's camera-shifted synthetic images (other images than upstream's: seed 1), scored
    there before and after (:func:`benchmarks.detection_device.device_fine_tune`)."""
    syn = cfg.data.synthetic or SyntheticDetectionConfig()
    return device_fine_tune(upstream, work, size=cfg.data.image_size or syn.size,
                            images=args.device_images, steps=args.device_steps,
                            effective_batch=args.device_batch, lr=args.device_lr,
                            cameras=[args.camera], scenes=Scenes.of(syn))


def pick_threads(requested: str) -> tuple[int, str]:
    """Torch threads for ``--threads`` (a number, or auto: the cores the 1-minute load
    average leaves free, at least one), and why."""
    cores = os.cpu_count() or 1
    if requested != "auto":
        try:
            n = int(requested)
        except ValueError:
            n = 0
        if n < 1:
            raise SystemExit(f"--threads {requested!r}: give auto or a count >= 1")
        return n, "--threads"
    load = os.getloadavg()[0]
    n = max(1, min(cores, cores - math.floor(load)))
    return n, f"auto: {cores} cores, load average {load:.2f}"


def host_line(threads: int, why: str) -> str:
    isa = detect_isa()
    return (f"host: {isa.model or 'unknown CPU'} ({isa.label}), {os.cpu_count()} cores; "
            f"torch {torch.__version__}, {threads} thread(s) ({why})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CONFIG,
                    help="the upstream training config (default: configs/detection_cpu.yaml; "
                    "configs/detection_demo.yaml is make demo's detector)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="cap on the seconds of upstream training steps (default: 300)")
    ap.add_argument("--threads", default="auto",
                    help="torch threads upstream, or auto: the cores the load leaves free "
                    "(default); the device job's children take one, as on a device")
    ap.add_argument("--images", type=int, default=None,
                    help="upstream synthetic images (default: the config's)")
    ap.add_argument("--size", type=int, default=None,
                    help="image side in px, upstream and on the device (default: the config's)")
    ap.add_argument("--batch", type=int, default=None,
                    help="upstream global batch (default: the config's)")
    ap.add_argument("--steps", type=int, default=None,
                    help="upstream optimizer steps, the schedule's length (default: the "
                    "config's)")
    ap.add_argument("--camera", default="rotate", choices=get_args(CameraKind),
                    help="the device camera its images are seen through (default: rotate)")
    ap.add_argument("--device-images", type=int, default=96,
                    help="the device's images, a quarter held out for health (default: 96)")
    ap.add_argument("--device-steps", type=int, default=40,
                    help="the device fine-tune's optimizer steps (default: 40)")
    ap.add_argument("--device-batch", type=int, default=16,
                    help="the device fine-tune's effective batch (default: 16)")
    ap.add_argument("--device-lr", type=float, default=0.001,
                    help="the device fine-tune's learning rate (default: 0.001)")
    args = parse_args(ap, {"images": 8, "size": 64, "batch": 4, "steps": 3,
                           "device_images": 24, "device_steps": 2, "device_batch": 8}, argv)
    threads, why = pick_threads(args.threads)
    torch.set_num_threads(threads)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="detection-bench-") as tmp:
        cfg = upstream_config(Path(tmp) / "upstream", args)
        up = train_upstream(cfg, args.budget_s)
        device = finetune_on_device(cfg, up.checkpoint, Path(tmp) / "device", args)
    total_s = time.perf_counter() - t0
    load1 = os.getloadavg()
    m = up.metrics
    syn = cfg.data.synthetic or SyntheticDetectionConfig()
    classes = len(syn.classes) if syn.classes else len(get_args(SyntheticClass))
    print(host_line(threads, why))
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in load0)} at the start, "
          f"{', '.join(f'{x:.1f}' for x in load1)} at the end")
    print(f"## upstream: {_shown(args.config)}: {cfg.model.name} "
          f"{cfg.model.kwargs} on {syn.images} synthetic images ({classes} classes, "
          f"{syn.objects[0]}-{syn.objects[1]} objects of {syn.object_size[0]:g}-"
          f"{syn.object_size[1]:g} of the side) at {cfg.data.image_size} px, budget "
          f"{args.budget_s:g} s")
    print("| what | figure |\n|---|---|")
    cut = f", cut by the budget at step {up.steps} of {up.scheduled_steps}" if up.cut else ""
    print(f"| steps (global batch {up.global_batch}) | {up.steps} in {fmt(up.train_s)} s"
          f"{cut}: {fmt(up.steps_per_s)} steps/s, {fmt(up.steps_per_s * up.global_batch)} "
          f"images/s |")
    print(f"| process CPU time of those steps | {fmt(up.cpu_s)} s "
          f"({fmt(up.cpu_s / up.train_s if up.train_s > 0 else math.nan)} cores on average) |")
    ratio = up.last_loss / up.first_loss
    print(f"| train/loss, mean of the first -> last {LOSS_WINDOW} steps | {fmt(up.first_loss)} "
          f"-> {fmt(up.last_loss)} ({fmt(ratio)}x) |")
    print(f"| mAP@0.5 | {fmt(m['eval/map50'])} |")
    print(f"| mAP@0.5:0.95 | {fmt(m['eval/map'])} |")
    print(f"| mAP@0.75, AR@100 | {fmt(m['eval/map75'])}, {fmt(m['eval/ar100'])} |")
    print(f"| evaluations ({up.evals}, {up.val_images} held-out images each) | "
          f"{fmt(up.eval_s)} s ({fmt(up.eval_cpu_s)} s CPU) |")
    print(f"| drawing the set + building the model | {fmt(up.data_s)} s |")
    print("\n".join(report_lines(device)))
    print(f"the whole command: {fmt(total_s)} s")
    within = device.job_peak_mb <= 1.05 * device.budget_mb
    verdict("detection device fine-tune mAP@0.5 gain", device.gain_pts, ">=",
            TARGET_GAIN_PTS, "pts",
            also=[(f"upstream mAP@0.5 {fmt(m['eval/map50'])} >= {TARGET_MAP50:g}",
                   m["eval/map50"] >= TARGET_MAP50),
                  (f"train/loss last/first {fmt(ratio)}x <= {TARGET_LOSS_RATIO:g}x",
                   ratio <= TARGET_LOSS_RATIO),
                  (f"schedule done inside {args.budget_s:g} s", not up.cut),
                  ("device whole-tree peak <= 1.05 x budget", within)],
            note=f"{args.camera} camera: mAP@0.5 {fmt(device.map50_before)} -> "
            f"{fmt(device.map50_after)}, {device.outcome}; micro-batch {device.micro_batch}, "
            f"peak predicted {fmt(device.predicted_peak_mb)} / measured "
            f"{fmt(device.finetune_peak_mb)} MB of {fmt(device.budget_mb)} MB; upstream "
            f"{fmt(up.steps_per_s)} steps/s, {fmt(up.cpu_s)} s CPU in {fmt(up.train_s)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
