"""The serving runtime (agent.runtime): what ActiveModel costs over a bare ONNX Runtime session,
what a hot swap costs a client under load, and what a device fine-tune on the same cores costs
the application, yielding or not. One function per section (``--sections``).

    python benchmarks/runtime.py [--sections overhead,swap,corun] [--threads 1] [--json PATH]
    python benchmarks/runtime.py --quick    # every section, tiny: its figures mean nothing

overhead and swap serve a small_cnn (width 32, 32 px, random weights) exported and quantized to
INT8 Q/DQ by the project's own exporters (this host's recipe), staged and committed through
real A/B slots (``ModelSlots.stage``/``commit``). The model is built in a child process so the
measuring process is torch-free, as an application's is.

overhead: ``ActiveModel.predict`` against ``ort_session(...).run`` on the same file, same
threads, same input, batch 1 and 32, in interleaved rounds; p50/p99 and the overhead
(target <= 3 % at p50).

swap: an open-loop client at ``--rate`` requests/s (latency counted from each request's
scheduled time, so a stall shows as the queue behind it) for ``--steady-s`` seconds, then
while a separate process (as the daemon's job would) stages and commits ``--commits`` new
versions ``--commit-interval-s`` apart. Failed and dropped requests (target 0), p50/p99 in
the steady phase against the commit phase, and commit-to-serving delays.

corun (issue 22, training yields to inference): an application with a p99 SLO beside a real
device fine-tune on the same cores. The device is the job tests' (``build_template``: a
small_cnn trained on clean digits, the device's distorted digits, keys); its digits@v1 is
published with the upstream's ONNX export (the exporters' pipeline, INT8 first) as its artefact
and pulled, so ``ActiveModel`` serves it; an open-loop client sends it ``--corun-rate``
requests/s of ``--corun-batch`` samples on 1 ONNX Runtime thread. Three runs, each on a fresh
device: the application alone (its p99 sets the SLO, ``--corun-slo-k`` x), then beside
``agentctl finetune --sensors sim --latency-slo-ms SLO`` with ``--no-yield-to-app``, then
yielding. Per run: the application's p50/p99 over the training loop (and over the whole
fine-tune step) and the share of its 1 s windows over the SLO; the step's wall time, the
training's steps/s, and ``yielded_s`` / ``fewer_threads_s`` / ``worst_app_p99_ms`` from the
job's report; the application's p99 while the governor held training at full duty, paced it or
yielded; the CPU the rest of the host used (and the hypervisor stole) meanwhile, so a run that
overlapped another load says so. The application serves at most ``--corun-max-s`` beside one
job (a yielding fine-tune can take many times its unpaced time); the figures then cover the
training up to there. Target: within the SLO while yielding, over it without. This section
builds its own device (torch in a child process), so it runs alone too: ``--sections corun``."""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # first: benchmarks/agent.py would shadow the package

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from agent.runtime.active_model import ActiveModel  # noqa: E402
from benchmarks.harness import meets, parse_args, verdict  # noqa: E402
from exporters.cpu_isa import detect_isa  # noqa: E402
from exporters.ort_runner import ort_session  # noqa: E402

MODEL = "digits"
IMAGE = 32
SHAPE = (1, IMAGE, IMAGE)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


# -- setup: the INT8 model and a device state dir ------------------------------------------


def _build_int8(out: str) -> None:
    """Child process: small_cnn -> ONNX -> INT8 Q/DQ (torch stays out of the parent)."""
    import torch

    from exporters.int8_recipe import choose_recipe
    from exporters.job import CalibrationConfig
    from exporters.onnx_export import INPUT_NAME, export_onnx
    from exporters.quantize import prepare_for_quantization, quantize_int8
    from hpc_core.models import build_model

    torch.manual_seed(0)
    model = build_model("small_cnn", num_classes=10, in_channels=1, image_size=IMAGE, width=32)
    work = Path(out).parent
    fp32 = export_onnx(model, work / "fp32.onnx", SHAPE).path
    prepared = prepare_for_quantization(fp32, work / "prepared.onnx")
    calib = np.random.default_rng(0).random((128, *SHAPE), dtype=np.float32)
    quantize_int8(prepared, Path(out), calib_inputs=calib, input_name=INPUT_NAME,
                  cfg=CalibrationConfig(samples=128), recipe=choose_recipe("onnxruntime",
                                                                           detect_isa()))


def _device(root: Path) -> Any:
    from registry.signing import generate_keypair, load_signing_key
    from tests.agent.runtime.conftest import Device

    keys = root / "keys"
    if not (keys / "bench.key.pem").exists():
        _, pub = generate_keypair(keys, "bench")
        (keys / "trusted").mkdir()
        (keys / "trusted" / pub.name).write_bytes(pub.read_bytes())
    return Device(root / "state", root / "work", load_signing_key(keys / "bench.key.pem"),
                  keys / "trusted")


@dataclass
class Setup:
    root: Path
    states: int = 0
    _onnx: Path | None = None

    @property
    def onnx(self) -> Path:
        """The INT8 model (random weights), built on first use: ``corun`` alone never needs it."""
        if self._onnx is None:
            onnx = self.root / "model.int8.onnx"
            _in_child(_build_int8, str(onnx), what="building the INT8 model")
            self._onnx = onnx
        return self._onnx

    def fresh_state(self) -> Path:
        """A new state dir with version 1 of the INT8 model committed."""
        self.states += 1
        root = self.root / f"s{self.states}"
        (root / "state").mkdir(parents=True)
        if self.states > 1:  # one key for every state dir
            (root / "keys").symlink_to(self.root / "s1" / "keys")
        _device(root).install(1, onnx_from=self.onnx)
        return root


def _in_child(target: Callable[..., None], *args: Any, what: str) -> None:
    """Run ``target`` in a spawned child: torch is imported there, never here."""
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    p.join()
    if p.exitcode != 0:
        raise SystemExit(f"{what} failed (exit {p.exitcode})")


def host_lines(args: argparse.Namespace, sections: list[str]) -> list[str]:
    isa = detect_isa()
    lines = [f"host: {isa.model or 'unknown CPU'}, {isa.label}, {os.cpu_count()} cores; "
             f"onnxruntime {ort.__version__} ({', '.join(ort.get_available_providers())})"]
    if {"overhead", "swap"} & set(sections):  # corun says what it serves itself
        lines.append(f"model: small_cnn width 32, {IMAGE} px, INT8 Q/DQ; ONNX Runtime threads "
                     f"{args.threads or 'default'}")
    return lines


# -- section: overhead ---------------------------------------------------------------------


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def section_overhead(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    root = setup.fresh_state()
    slot_onnx = root / "state/models" / MODEL / "current/artefacts/model.onnx"
    bare = ort_session(slot_onnx, threads=args.threads)
    name, out = bare.get_inputs()[0].name, [bare.get_outputs()[0].name]
    rows = {}
    with ActiveModel(root / "state", MODEL, threads=args.threads) as model:
        for batch in (1, 32):
            x = np.random.default_rng(1).random((batch, *SHAPE), dtype=np.float32)
            np.testing.assert_array_equal(model.predict(x), bare.run(out, {name: x})[0])
            runs: dict[str, list[float]] = {"bare": [], "active": []}
            fns = {"bare": lambda x=x: bare.run(out, {name: x}),
                   "active": lambda x=x: model.predict(x)}
            per_round = max(20, args.iters // args.rounds // (8 if batch > 1 else 1))
            for f in fns.values():
                _timed(f, per_round)  # warm
            for r in range(args.rounds):  # interleaved, the order alternating
                for k in (("bare", "active") if r % 2 == 0 else ("active", "bare")):
                    runs[k] += _timed(fns[k], per_round)
            rows[batch] = {k: {"p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99), "n": len(v)}
                           for k, v in runs.items()}
    print("\n== overhead: ActiveModel.predict vs a bare ort_session on the same file ==")
    print(f"{'batch':>5} {'runtime':<22} {'p50 ms':>8} {'p99 ms':>8} {'n':>6}")
    for batch, r in rows.items():
        for k, label in (("bare", "ort_session().run"), ("active", "ActiveModel.predict")):
            print(f"{batch:>5} {label:<22} {r[k]['p50_ms']:>8.3f} {r[k]['p99_ms']:>8.3f} "
                  f"{r[k]['n']:>6}")
        over50 = 100 * (r["active"]["p50_ms"] / r["bare"]["p50_ms"] - 1)
        over99 = 100 * (r["active"]["p99_ms"] / r["bare"]["p99_ms"] - 1)
        r["overhead_p50_pct"], r["overhead_p99_pct"] = over50, over99
        print(f"{batch:>5} overhead: p50 {over50:+.1f} % (target <= 3 %: "
              f"{'OK' if over50 <= 3 else 'MISSED'}), p99 {over99:+.1f} %")
    return {str(b): r for b, r in rows.items()}


# -- section: hot swap under load -------------------------------------------------------------


def _commit_loop(root: str, onnx: str, commits: int, interval_s: float, start_at: float,
                 out: Any) -> None:
    """Child process, the daemon's part: stage and commit versions 2..commits+1."""
    device = _device(Path(root))
    for i in range(commits):
        time.sleep(max(0.0, start_at + i * interval_s - time.time()))
        device.stage(i + 2, onnx_from=Path(onnx))
        device.commit(i + 2)
        out.put((i + 2, time.time()))


def section_swap(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    root = setup.fresh_state()
    x = np.random.default_rng(2).random((1, *SHAPE), dtype=np.float32)
    jobs: queue.Queue[tuple[float, float] | None] = queue.Queue()
    done: list[tuple[float, float, str]] = []  # (scheduled wall time, latency ms, version)
    failed: list[str] = []
    ctx = mp.get_context("spawn")
    commits_q = ctx.Queue()
    with ActiveModel(root / "state", MODEL, threads=args.threads, poll_s=args.poll_s) as model:
        def worker() -> None:
            while (job := jobs.get()) is not None:
                wall, mono = job
                try:
                    _, version = model.predict_versioned(x)
                    done.append((wall, (time.monotonic() - mono) * 1e3, version))
                except Exception as e:
                    failed.append(repr(e))

        workers = [threading.Thread(target=worker) for _ in range(args.clients)]
        for t in workers:
            t.start()
        swap_start = time.time() + args.steady_s
        committer = ctx.Process(target=_commit_loop, args=(
            str(root), str(setup.onnx), args.commits, args.commit_interval_s, swap_start,
            commits_q))
        committer.start()
        end = swap_start + args.commits * args.commit_interval_s + 2.0
        t0_wall, t0 = time.time(), time.monotonic()
        sent = 0
        while t0_wall + sent / args.rate < end:
            due = t0 + sent / args.rate
            time.sleep(max(0.0, due - time.monotonic()))
            jobs.put((t0_wall + sent / args.rate, due))
            sent += 1
        for _ in workers:
            jobs.put(None)
        for t in workers:
            t.join(30)
        committer.join(60)
        stats = model.stats()
    commits = dict(commits_q.get(timeout=5) for _ in range(args.commits))
    first_served = {}
    for wall, _, v in sorted(done):
        first_served.setdefault(int(v), wall)
    delays = [1e3 * (first_served[v] - t) for v, t in commits.items() if v in first_served]
    steady = [ms for wall, ms, _ in done if wall < swap_start]
    swapping = [ms for wall, ms, _ in done if wall >= swap_start]
    dropped = sent - len(done) - len(failed)
    served = sorted({int(v) for *_, v in done})
    res = {
        "rate": args.rate, "sent": sent, "failed": len(failed), "dropped": dropped,
        "commits": len(commits), "swaps": stats.swaps, "versions_served": len(served),
        "steady": {"n": len(steady), "p50_ms": pct(steady, 0.5), "p99_ms": pct(steady, 0.99)},
        "swapping": {"n": len(swapping), "p50_ms": pct(swapping, 0.5),
                     "p99_ms": pct(swapping, 0.99), "max_ms": max(swapping)},
        "commit_to_serving_ms": {"median": statistics.median(delays) if delays else None,
                                 "max": max(delays) if delays else None},
    }
    print(f"\n== hot swap under load: {args.rate:g} req/s (batch 1), {args.commits} commits "
          f"{args.commit_interval_s:g} s apart from another process, poll {args.poll_s:g} s ==")
    print(f"requests sent {sent}, failed {len(failed)}, dropped {dropped} (target 0: "
          f"{'OK' if not failed and not dropped else 'MISSED'}); commits {len(commits)}, "
          f"swaps {stats.swaps}, versions served {len(served)} of {len(commits) + 1}")
    print(f"{'phase':<16} {'n':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for label, k in (("steady", "steady"), ("during commits", "swapping")):
        print(f"{label:<16} {res[k]['n']:>6} {res[k]['p50_ms']:>8.3f} {res[k]['p99_ms']:>8.3f}")
    print(f"p99 during commits / steady: {res['swapping']['p99_ms'] / res['steady']['p99_ms']:.2f}x"
          f"; worst request during commits {res['swapping']['max_ms']:.2f} ms")
    if delays:
        print(f"commit -> first answer from the new version: median {statistics.median(delays):.0f}"
              f" ms, max {max(delays):.0f} ms (load + warm-up + up to one poll)")
    if failed:
        print(f"first failure: {failed[0]}")
    return res


# -- section: co-running with a device fine-tune ------------------------------------------------

CORUN_UPSTREAM = ["model.kwargs={width: 16, norm: group}"]
"""The served and fine-tuned model: small_cnn (GroupNorm, width 16) on digits at 16 px, trained
``--corun-upstream-epochs``."""
JOB_ID = "corun"


def _build_corun(root: str, epochs: int = 4) -> None:
    """Child process (torch): the job tests' device (an upstream trained on clean digits, the
    device's distorted digits, keys), the upstream exported by the project's exporters (INT8
    first), and digits@v1 published with that ONNX file as its artefact."""
    from exporters.job import ExportJob
    from exporters.pipeline import run_export
    from hpc_core.model_spec import read_checkpoint
    from registry.publish import publish_content
    from registry.signing import load_signing_key
    from registry.stores import LocalStore
    from tests.agent.jobs.conftest import build_template

    base = Path(root)
    template = build_template(base / "template",
                              upstream=[f"training.epochs={epochs}", *CORUN_UPSTREAM])
    report = run_export(ExportJob(checkpoint=template / "up", out_dir=base / "export",
                                  precision="int8", gates={"latency_iters": 5}))
    if report.status != "passed":
        raise SystemExit(f"export of the upstream failed: {report.fallback_reason}")
    (base / "registry").mkdir()
    key = load_signing_key(Path((template / "upstream.key").read_text()))
    publish_content(read_checkpoint(template / "up"), LocalStore(base / "registry"), name=MODEL,
                    version="v1", key=key, artefacts=[base / "export" / "model.onnx"])


def _corun_state(base: Path, run: str) -> Path:
    """A fresh device: the template's keys, digits@v1 (with its ONNX file) pulled and active."""
    from agent.storage.update import update
    from registry.refs import parse_ref
    from registry.signing import load_trusted_keys

    state = base / run / "state"
    shutil.copytree(base / "template" / "state", state)
    update(parse_ref(f"{MODEL}@v1", str(base / "registry")), state_dir=state,
           trusted=load_trusted_keys(state / "trusted_keys"))
    return state


class CpuMeter:
    """Busy CPU time of the whole host against this process's own (its threads, and its
    descendants once reaped): what the rest of the host used meanwhile says whether another
    load overlapped a run; the time the hypervisor stole, whether a neighbour did."""

    def __init__(self) -> None:
        self.t0, self.host0, self.own0 = time.monotonic(), _host_cpu_s(), _own_cpu_s()

    def cores(self) -> dict[str, float]:
        """Mean cores the rest of the host kept busy, and stole, since the meter started."""
        (busy, steal), (busy0, steal0) = _host_cpu_s(), self.host0
        wall = time.monotonic() - self.t0
        return {"others_cores": max(0.0, busy - busy0 - (_own_cpu_s() - self.own0)) / wall,
                "steal_cores": (steal - steal0) / wall}


def _host_cpu_s() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole host since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Served:
    """One run of the application: per request, its scheduled wall time, the latency its
    client saw (from the scheduled time: queueing included) and ``predict``'s own time."""

    at: list[float]
    client_ms: list[float]
    serve_ms: list[float]
    sent: int = 0
    failed: int = 0

    def figures(self, slo_ms: float | None, t0: float = 0.0, t1: float = float("inf")
                ) -> dict[str, Any]:
        """p50/p99 over [t0, t1) and the share of its 1 s windows whose p99 is over the SLO."""
        keep = [i for i, t in enumerate(self.at) if t0 <= t < t1]
        if not keep:
            raise SystemExit("corun: no request was served in the measured interval")
        serve = [self.serve_ms[i] for i in keep]
        windows: dict[int, list[float]] = {}
        for i in keep:
            windows.setdefault(int(self.at[i] - self.at[keep[0]]), []).append(self.serve_ms[i])
        p99s = [pct(w, 0.99) for w in windows.values() if len(w) >= 20]  # no cut-off second
        over = sum(p > slo_ms for p in p99s) if slo_ms is not None else 0
        return {"n": len(keep), "failed": self.failed, "p50_ms": pct(serve, 0.5),
                "p99_ms": pct(serve, 0.99), "max_ms": max(serve),
                "client_p99_ms": pct([self.client_ms[i] for i in keep], 0.99),
                "windows": len(p99s), "windows_over_slo": over, "window_p99_ms": p99s,
                "seconds": self.at[keep[-1]] - self.at[keep[0]]}


def _serve(state: Path, slo_ms: float | None, args: argparse.Namespace, max_s: float,
           done: Callable[[], bool] = lambda: False, start: Callable[[], None] | None = None
           ) -> Served:
    """The application: ``ActiveModel`` (1 worker thread, ``--corun-batch`` samples a request)
    behind an open-loop client at ``--corun-rate``, until ``done()`` (asked ten times a second)
    or ``max_s``. ``start`` runs on a timer thread ``--corun-lead-s`` after the first request,
    so the application's stats are there before a job starts."""
    jobs: queue.Queue[float | None] = queue.Queue()
    out = Served([], [], [])
    with ActiveModel(state, MODEL, slo_ms=slo_ms, threads=args.threads,
                     stats_window_s=args.corun_stats_window_s) as model:
        assert model.engine is not None
        x = np.random.default_rng(3).random(
            (args.corun_batch, *model.engine.input_shape[1:]), dtype=np.float32)

        def worker() -> None:
            while (due := jobs.get()) is not None:
                t0 = time.perf_counter()
                try:
                    model.predict(x)
                except Exception:
                    out.failed += 1
                    continue
                t1 = time.perf_counter()
                out.at.append(wall0 + (due - mono0))
                out.serve_ms.append((t1 - t0) * 1e3)
                out.client_ms.append((time.monotonic() - due) * 1e3)

        wall0, mono0 = time.time(), time.monotonic()
        thread = threading.Thread(target=worker)
        thread.start()
        timer = threading.Timer(args.corun_lead_s, start) if start is not None else None
        if timer is not None:
            timer.start()
        check_every = max(1, int(args.corun_rate / 10))
        while out.sent / args.corun_rate < max_s:
            if out.sent % check_every == 0 and done():
                break
            due = mono0 + out.sent / args.corun_rate
            time.sleep(max(0.0, due - time.monotonic()))
            jobs.put(due)
            out.sent += 1
        if timer is not None:
            timer.join()
        jobs.put(None)
        thread.join(30)
    return out


def _finetune_argv(state: Path, base: Path, slo_ms: float, yield_to_app: bool,
                   args: argparse.Namespace) -> list[str]:
    # --profile sim: the simulated Orin Nano whose board (STATE/sim) the sim sensors read; at
    # time scale 1 it stays ~30 C under its thermal target in a run this short, so only the
    # latency loop moves the duty (the report's samples say which limit did).
    return [sys.executable, "-m", "agent.cli", "finetune", "--model", MODEL,
            "--data", str(base / "template" / "device.npz"), "--state-dir", str(state),
            "--profile", "sim", "--sensors", "sim", "--trainable", "all",
            "--steps", str(args.corun_steps), "--micro-batch", "64", "--lr", "0.003",
            "--checkpoint-every", str(args.corun_steps), "--no-export",
            "--latency-slo-ms", f"{slo_ms:.4f}", "--job-id", JOB_ID, "--progress", "json",
            *([] if yield_to_app else ["--no-yield-to-app"])]


def _corun_job(base: Path, run: str, slo_ms: float, yield_to_app: bool,
               args: argparse.Namespace) -> dict[str, Any]:
    """The application served while ``agentctl finetune`` runs beside it on a fresh device:
    the application's figures over the fine-tune step, and the job's own."""
    from agent.jobs.store import JobStore

    state = _corun_state(base, run)
    job_dir = state / "jobs" / JOB_ID
    log_path = base / run / "finetune.log"
    procs: list[subprocess.Popen[bytes]] = []
    env = dict(os.environ)
    if args.corun_train_threads:
        env["OMP_NUM_THREADS"] = str(args.corun_train_threads)

    def done() -> bool:  # the fine-tune step is over: its child wrote its result
        return bool(procs) and (procs[0].poll() is not None
                                or (job_dir / "finetune.json").exists())

    meter = CpuMeter()
    with open(log_path, "wb") as log:
        def start() -> None:
            procs.append(subprocess.Popen(
                _finetune_argv(state, base, slo_ms, yield_to_app, args), cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, env=env))

        try:
            served = _serve(state, slo_ms, args, args.corun_max_s, done, start)
            cut_short = not done()  # --corun-max-s ran out first: said, never hidden
            if not procs:
                raise SystemExit(f"corun {run}: the fine-tune did not start")
            rc = procs[0].wait(600)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    load = meter.cores()
    step = next((s for s in JobStore(state).steps(JOB_ID) if s.name == "finetune"), None)
    report = job_dir / "finetune" / "report.json"
    if step is None or step.finished_at is None or not report.is_file():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise SystemExit(f"corun {run}: the fine-tune did not finish (exit {rc}):\n{tail}")
    assert step.started_at is not None
    governed = json.loads(report.read_text())
    summary = governed["summary"]
    # The training loop's span in wall time, from the trainer's metrics.jsonl: the first
    # record closes the evaluation before training, the last train record is the last step.
    # The rest of the step (torch import, data, evaluations, the report's plot) is unpaced.
    records = [json.loads(ln) for ln in (job_dir / "finetune" / "metrics.jsonl").open()]
    trained = [r["time"] for r in records if "train/loss" in r]
    # Throughput while the application served: all of the loop, or up to --corun-max-s.
    start, end = records[0]["time"], min(trained[-1], served.at[-1])
    steps_served = max((r["step"] for r in records if "train/loss" in r and r["time"] <= end),
                       default=0)
    timeline = [{k: g[k] for k in ("t_s", "step", "duty", "limit", "app_p99_ms")}
                for g in governed["samples"]]
    return {
        "app": served.figures(slo_ms, start, end),
        "app_step": served.figures(slo_ms, step.started_at, step.finished_at),
        "app_cut_short": cut_short, **load,
        "job": {"exit": rc, "step_s": step.finished_at - step.started_at,
                "train_s": trained[-1] - start, "steps": summary["steps"],
                "steps_per_s": steps_served / (end - start),
                "governed_s": summary["elapsed_s"],
                "compute_s": summary["compute_s"], "yielded_s": summary["yielded_s"],
                "fewer_threads_s": summary.get("fewer_threads_s", 0.0),
                "worst_app_p99_ms": summary["worst_app_p99_ms"],
                "mean_duty": summary["mean_duty"], "timeline": timeline},
        "app_by_duty": _by_duty(served, timeline, records),
    }


def _by_duty(served: Served, timeline: list[dict[str, Any]], records: list[dict[str, Any]]
             ) -> dict[str, dict[str, float]]:
    """The application's p99 while the governor held training at full duty, paced it, or
    yielded completely: what is left over the SLO while nothing trains is not the fine-tune's.

    The governor's samples (~1 s apart) carry seconds since its start; the trainer's records,
    wall time at the end of every 5th step. A sample is taken after that step's pause, so the
    first sample at a logged step is the record's time plus one pause: the median over them
    places the samples on the wall clock within about one step's pause."""
    first: dict[int, float] = {}
    for g in timeline:
        first.setdefault(g["step"], g["t_s"])
    offsets = sorted(r["time"] - first[r["step"]] for r in records
                     if "train/loss" in r and r["step"] in first)
    if not offsets:
        return {}
    offset = offsets[len(offsets) // 2]
    spans = [(g["t_s"] + offset, nxt["t_s"] + offset, g["duty"])
             for g, nxt in itertools.pairwise(timeline)]
    kinds: dict[str, tuple[list[float], float]] = {}
    j = 0
    order = sorted(range(len(served.at)), key=served.at.__getitem__)
    last = served.at[order[-1]]
    for t0, t1, duty in spans:
        if t0 >= last:  # the application had stopped (--corun-max-s)
            break
        t1 = min(t1, last)
        kind = "full" if duty >= 0.995 else "yielded" if duty <= 0 else "paced"
        lat, secs = kinds.get(kind, ([], 0.0))
        while j < len(order) and served.at[order[j]] < t0:
            j += 1
        while j < len(order) and served.at[order[j]] < t1:
            lat.append(served.serve_ms[order[j]])
            j += 1
        kinds[kind] = (lat, secs + t1 - t0)
    return {k: {"seconds": secs, "n": len(lat), "p99_ms": pct(lat, 0.99)}
            for k, (lat, secs) in kinds.items() if lat}


def _duty_line(timeline: list[dict[str, Any]]) -> str:
    """One character per governor sample (~1 s): # full duty, 0-9 tenths, . yielded."""
    return "".join("#" if g["duty"] >= 0.995 else "." if g["duty"] <= 0 else
                   str(min(9, int(g["duty"] * 10))) for g in timeline)


def section_corun(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    base = setup.root / "corun"
    base.mkdir()
    t0 = time.monotonic()
    _in_child(_build_corun, str(base), args.corun_upstream_epochs,
              what="building the co-run device")
    built_s = time.monotonic() - t0
    export = json.loads((base / "export" / "report.json").read_text())
    won = next(a for a in export["attempts"] if a["passed"])
    meter = CpuMeter()
    alone = _serve(_corun_state(base, "alone"), None, args, args.corun_baseline_s)
    p99_alone = alone.figures(None)["p99_ms"]
    slo = args.corun_slo_k * p99_alone
    runs: dict[str, dict[str, Any]] = {
        "alone": {"app": alone.figures(slo), **meter.cores(), "job": None}}
    for name, yield_to_app in (("no-yield", False), ("yield", True)):
        runs[name] = _corun_job(base, name, slo, yield_to_app, args)

    threads = args.corun_train_threads or os.environ.get("OMP_NUM_THREADS") or "1 (the job's)"
    print(f"\n== corun: the application beside a device fine-tune on the same {os.cpu_count()} "
          "cores ==")
    print(f"app: ActiveModel serving digits@v1 ({won['step']} ONNX of a trained small_cnn, "
          f"GroupNorm width 16, 16 px), batch {args.corun_batch}, {args.threads} ONNX Runtime "
          f"thread(s), open loop "
          f"at {args.corun_rate:g} req/s, stats window {args.corun_stats_window_s:g} s")
    print(f"fine-tune: agentctl finetune --profile sim --sensors sim --trainable all --steps "
          f"{args.corun_steps} --micro-batch 64 --no-export --latency-slo-ms SLO "
          f"[--no-yield-to-app]; torch threads {threads}; set-up built in {built_s:.0f} s")
    print(f"SLO = {args.corun_slo_k:g} x p99 alone ({p99_alone:.3f} ms) = {slo:.3f} ms, on "
          "predict's own time (what the governor reads); application figures over the "
          "training loop")
    print(f"{'run':<9} {'p50 ms':>6} {'p99 ms':>6} {'p99/SLO':>7} {'client p99':>10} "
          f"{'windows>SLO':>11} {'step s':>6} {'train s':>7} {'steps/s':>7} {'yielded s':>9} "
          f"{'fewer thr s':>11} {'job worst p99':>13} {'others/steal cores':>18}")
    for name, r in runs.items():
        a, j = r["app"], r["job"]
        over = f"{a['windows_over_slo']}/{a['windows']}"
        line = (f"{name:<9} {a['p50_ms']:>6.3f} {a['p99_ms']:>6.3f} {a['p99_ms'] / slo:>7.2f} "
                f"{a['client_p99_ms']:>10.3f} {over:>11}")
        if j is None:
            line += f" {'-':>6} {'-':>7} {'-':>7} {'-':>9} {'-':>11} {'-':>13}"
        else:
            worst = j["worst_app_p99_ms"]
            line += (f" {j['step_s']:>6.1f} {j['train_s']:>7.1f} {j['steps_per_s']:>7.1f} "
                     f"{j['yielded_s']:>9.1f} {j['fewer_threads_s']:>11.1f} "
                     f"{'-' if worst is None else f'{worst:.3f}':>13}")
        print(f"{line} {r['others_cores']:>12.2f} /{r['steal_cores']:>4.2f}")
    ny, y = runs["no-yield"], runs["yield"]
    cost = y["job"]["steps_per_s"] / ny["job"]["steps_per_s"]
    print(f"p99 / alone: no-yield {ny['app']['p99_ms'] / p99_alone:.2f}x, yield "
          f"{y['app']['p99_ms'] / p99_alone:.2f}x; fine-tune steps/s yield / no-yield "
          f"{cost:.2f} (step wall time {y['job']['step_s'] / ny['job']['step_s']:.2f}x)")
    for name in ("no-yield", "yield"):
        w = runs[name]["app_step"]
        print(f"{name}: over the whole fine-tune step ({w['seconds']:.0f} s: with the unpaced "
              f"start-up, evaluations and report) p99 {w['p99_ms']:.3f} ms, "
              f"{w['windows_over_slo']}/{w['windows']} windows over the SLO")
    parts = [f"{k} {v['p99_ms']:.3f} ms ({v['seconds']:.0f} s)"
             for k, v in y["app_by_duty"].items()]
    print(f"yield: the application's p99 by the governor's duty: {', '.join(parts)}")
    print("duty per second (# full, 0-9 tenths, . yielded):")
    for name in ("no-yield", "yield"):
        print(f"  {name + ':':<9} {_duty_line(runs[name]['job']['timeline'])}")
        if runs[name]["app_cut_short"]:
            print(f"  {name}: the application stopped (--corun-max-s) before the fine-tune "
                  "ended: its figures and steps/s cover the training up to then")
    busy = [n for n, r in runs.items()
            if r["others_cores"] + r["steal_cores"] > args.corun_max_others_cores]
    if busy:
        print(f"other processes (or the hypervisor) took > {args.corun_max_others_cores:g} "
              f"cores during {', '.join(busy)}: another load overlapped; rerun on a quiet host")
    within = y["app"]["p99_ms"] <= slo
    violated = ny["app"]["p99_ms"] > slo
    idle = y["app_by_duty"].get("yielded")
    if not within and idle is not None and idle["p99_ms"] > slo:
        print(f"while training yielded completely ({idle['seconds']:.0f} s) the application's p99 "
              f"was {idle['p99_ms']:.3f} ms, over the SLO: what keeps it there is not the "
              "fine-tune's training steps")
    print(f"target: within the SLO with yielding: {'OK' if within else 'MISSED'}; over it "
          f"without: {'shown' if violated else 'NOT shown'}")
    return {"slo_ms": slo, "slo_k": args.corun_slo_k, "export_step": won["step"],
            "built_s": built_s, "runs": runs, "steps_per_s_ratio": cost,
            "within_slo_yielding": within, "violated_without": violated}


SECTIONS: dict[str, Callable[[Setup, argparse.Namespace], dict[str, Any]]] = {
    "overhead": section_overhead,
    "swap": section_swap,
    "corun": section_corun,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of: {', '.join(SECTIONS)}")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--iters", type=int, default=4000, help="overhead: timed calls per runtime")
    ap.add_argument("--rounds", type=int, default=10, help="overhead: interleaved rounds")
    ap.add_argument("--rate", type=float, default=200.0, help="swap: requests per second")
    ap.add_argument("--clients", type=int, default=2, help="swap: client threads")
    ap.add_argument("--steady-s", type=float, default=5.0, help="swap: seconds before commits")
    ap.add_argument("--commits", type=int, default=20)
    ap.add_argument("--commit-interval-s", type=float, default=0.5)
    ap.add_argument("--poll-s", type=float, default=0.2, help="ActiveModel's poll interval")
    ap.add_argument("--corun-rate", type=float, default=200.0,
                    help="corun: the application's requests per second")
    ap.add_argument("--corun-batch", type=int, default=1,
                    help="corun: samples per request (32 stands for a heavier model: requests "
                    "of ~20 ms, against which a VM's millisecond stalls are small)")
    ap.add_argument("--corun-baseline-s", type=float, default=15.0,
                    help="corun: seconds the application runs alone")
    ap.add_argument("--corun-slo-k", type=float, default=1.5,
                    help="corun: the SLO as a multiple of the p99 alone (the fine-tune raises "
                    "it ~1.7-3x on a quiet 2-core host: a larger k leaves nothing to yield for)")
    ap.add_argument("--corun-steps", type=int, default=500,
                    help="corun: the fine-tune's optimizer steps")
    ap.add_argument("--corun-stats-window-s", type=float, default=10.0,
                    help="corun: ActiveModel's stats window (its default: 10)")
    ap.add_argument("--corun-train-threads", type=int, default=0,
                    help="corun: OMP_NUM_THREADS of the fine-tune (0: the job's default)")
    ap.add_argument("--corun-lead-s", type=float, default=2.0,
                    help="corun: the application serves this long before the job starts")
    ap.add_argument("--corun-max-s", type=float, default=120.0,
                    help="corun: longest the application serves beside one job")
    ap.add_argument("--corun-max-others-cores", type=float, default=0.15,
                    help="corun: warn when other processes and steal took more cores")
    ap.add_argument("--corun-upstream-epochs", type=int, default=4,
                    help="corun: epochs of the served model's upstream training")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = parse_args(ap, {
        "iters": 200, "rounds": 2, "rate": 100.0, "steady_s": 0.5, "commits": 2,
        "commit_interval_s": 0.3, "corun_rate": 100.0, "corun_baseline_s": 1.5,
        "corun_steps": 10, "corun_lead_s": 0.5, "corun_max_s": 60.0,
        "corun_upstream_epochs": 1})
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    print("\n".join(host_lines(args, wanted)))
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        setup = Setup(Path(tmp))
        results = {name: SECTIONS[name](setup, args) for name in wanted}
    if args.json:
        args.json.write_text(json.dumps({"host": host_lines(args, wanted), **results}, indent=2))
    print_verdict(results)
    return 0


def print_verdict(results: dict[str, dict[str, Any]]) -> None:
    """corun's (else overhead's, else swap's) headline target; the other sections' counted."""
    also: list[tuple[str, bool]] = []
    heads: list[tuple[str, float, str, float, str]] = []
    if "corun" in results:
        c = results["corun"]
        heads.append(("corun: application p99 yielding / SLO ratio",
                      c["runs"]["yield"]["app"]["p99_ms"] / c["slo_ms"], "<=", 1.0, "x"))
        also.append(("corun: over the SLO without yielding", c["violated_without"]))
    if "overhead" in results:
        heads.append(("ActiveModel overhead over a bare session at p50 (batch 1)",
                      results["overhead"]["1"]["overhead_p50_pct"], "<=", 3.0, "%"))
    if "swap" in results:
        w = results["swap"]
        heads.append(("hot swap: failed + dropped requests", w["failed"] + w["dropped"], "==",
                      0.0, ""))
    (what, value, op, target, unit), rest = heads[0], heads[1:]
    also += [(name, meets(v, o, t)) for name, v, o, t, _ in rest]
    verdict(what, value, op, target, unit, also=also)


if __name__ == "__main__":
    sys.exit(main())
