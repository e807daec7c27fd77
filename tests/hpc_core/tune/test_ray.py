"""hpc-train tune --backend ray: real searches of real digits runs on a real Ray cluster, started
here on loopback (`ray start --head`, two CPUs) and stopped afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray.tune")
pytest.importorskip("optuna")

from hpc_core.cli import main
from hpc_core.config import load_config
from hpc_core.tune.ray_backend import asha_max_t
from hpc_core.tune.search_space import SearchSpace, load_space
from tests.hpc_core.tune.test_study_run import study_runs
from tests.support.mosquitto import free_port

REPO = Path(__file__).resolve().parents[3]

# Small and short, as the Optuna backend's tests: a narrow CNN on 8x8 digits, evaluated every
# 10 steps.
SETS = [
    "training.epochs=null",
    "training.max_steps=30",
    "training.eval_every_steps=10",
    "model.kwargs.norm=none",
    "checkpoint.best_metric=null",
    "data.image_size=8",
]


def _ray_pids(token: str) -> list[int]:
    """Every process of this cluster: they all inherit its token (some rename themselves, as
    ray::DashboardAgent, so their command line does not tell)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"RAY_AUTH_TOKEN={token}".encode() in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict[str, str]]:
    """A Ray head on 127.0.0.1 with two CPUs; yields its address and the environment a driver
    needs (the checkout on PYTHONPATH). Every Ray process is gone afterwards."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Token authentication, with a token of this cluster's own: never ~/.ray/auth_token.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    for k in list(env):
        if k.startswith("HPC_FAULT_") or k == "RAY_ADDRESS":
            del env[k]
    cmd = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
        "--include-dashboard=false", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={free_port()}", f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}", "--disable-usage-stats",
    ]  # fmt: skip
    head = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert head.stdout is not None
        seen = []
        for line in head.stdout:
            seen.append(line)
            if "Ray runtime started" in line:
                break
        else:
            pytest.fail("ray start did not start:\n" + "".join(seen[-40:]))
        # Drain the rest of its output so it never blocks on a full pipe.
        subprocess.Popen(["cat"], stdin=head.stdout, stdout=subprocess.DEVNULL)
        yield {"address": f"127.0.0.1:{port}", "env": env, "temp_dir": temp_dir}  # type: ignore[misc]
    finally:
        # `ray start --block` stops the processes it started when it is interrupted; `ray stop`
        # is not used: it would stop every Ray of this user on the machine.
        head.send_signal(signal.SIGINT)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        deadline = time.monotonic() + 30
        token = env["RAY_AUTH_TOKEN"]
        while _ray_pids(token) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _ray_pids(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        leftover = _ray_pids(token)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftover, f"Ray processes left running: {leftover}"


def _args(
    cluster: dict[str, str], space: Path, out: Path, trials: int, sets: list[str] = SETS
) -> list[str]:
    args = ["tune", "--backend", "ray", "--address", cluster["address"], "--cpus-per-trial", "1"]
    args += ["--config", str(REPO / "configs/digits.yaml"), "--space", str(space)]
    args += ["--trials", str(trials), "--out", str(out), "--log-format", "json"]
    for s in sets:
        args += ["--set", s]
    return args


def _run(cluster: dict[str, str], args: list[str], timeout: float = 240) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "hpc_core.cli", *args],
        env=cluster["env"],  # type: ignore[arg-type]
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout, p.stderr


def _table(summary: str) -> list[dict[str, str]]:
    rows = [line.split(" | ") for line in summary.splitlines() if re.match(r"\| \d+ \|", line)]
    keys = ["trial", "state", "value", "steps", "seconds", "worker", "params", "error"]
    return [dict(zip(keys, [c.strip(" |") for c in r], strict=True)) for r in rows]


def _checkpoints(out: Path) -> list[Path]:
    return sorted(out.glob("ray/digits/*/checkpoint_*"))


def test_search_completes_with_asha_and_best_config_trains(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    space = tmp_path / "space.yaml"
    # Rates that learn and rates that do not: ASHA has trials to stop.
    space.write_text(
        "study: {metric: eval/acc, pruner: median, n_startup_trials: 2, seed: 0}\n"
        "params:\n"
        "  optimizer.lr: {type: float, low: 1.0e-5, high: 1.0, log: true}\n"
        "  model.kwargs.width: {type: categorical, choices: [4, 8]}\n"
    )
    out = tmp_path / "tune"
    sets = [*SETS, "logging.mlflow=true"]
    rc, stdout, stderr = _run(ray_cluster, _args(ray_cluster, space, out, trials=4, sets=sets))
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert stdout.startswith(summary)  # printed as the Optuna backend prints it
    tally = re.match(r"(\d) complete, (\d) pruned, 0 fail, 0 running \(study 'digits'\)", summary)
    assert tally and int(tally[1]) + int(tally[2]) == 4, summary
    rows = _table(summary)
    assert [r["trial"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows:
        assert (out / f"trial_{int(r['trial']):04d}" / "metrics.jsonl").exists()
        # A complete trial ran all 30 steps; ASHA stopped a pruned one at an evaluation.
        assert r["steps"] == "30" if r["state"] == "complete" else r["steps"] in ("10", "20")
        assert re.fullmatch(r".+:\d+", r["worker"]), r  # host:pid of the Ray worker
    assert (out / "history.png").stat().st_size > 1000
    # Tracking: the experiment's MLflow parent run, each trial's run nested under it, ended as
    # its trial ended (a pruned one FINISHED, tagged PRUNED), the best trial on the parent.
    parent, children = study_runs(out)
    assert parent.info.status == "FINISHED"
    states = {r["trial"]: r["state"] for r in rows}
    by_trial = {r.data.tags["edgetrain.trial"]: r for r in children}
    assert sorted(by_trial) == sorted(states) and len(children) == 4
    for number, run in by_trial.items():
        assert run.info.status == "FINISHED"
        assert run.data.tags["edgetrain.trial_state"] == states[number].upper()
    assert parent.data.metrics["best/eval/acc"] == pytest.approx(
        max(float(r["value"]) for r in rows if r["state"] == "complete"), abs=5e-5
    )
    # Ray's checkpoints are the project's checkpoint folders: safetensors and JSON, no pickle.
    ckpts = _checkpoints(out)
    assert ckpts
    for c in ckpts:
        names = {p.name for p in c.iterdir()}
        assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= names
        assert not [n for n in names if n.endswith((".pkl", ".pt", ".pth"))], names
    # best_config.yaml is the Optuna backend's: `hpc-train train` trains it to the best value.
    best_value = max(float(r["value"]) for r in rows if r["state"] == "complete")
    cfg = load_config(out / "best_config.yaml")
    header = (out / "best_config.yaml").read_text().splitlines()[0]
    assert header.startswith("# best trial ") and "study 'digits'" in header
    assert main(["train", "--config", str(out / "best_config.yaml")]) == 0
    final = [
        json.loads(line)
        for line in (cfg.run.output_dir / "metrics.jsonl").read_text().splitlines()
        if '"eval/acc"' in line
    ][-1]
    assert final["eval/acc"] == pytest.approx(best_value, abs=5e-5)  # the table's 4 decimals


def test_a_raising_trial_fails_and_is_replaced_and_failures_in_a_row_stop_it(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    # Random sampling with a seed: the trials' rates are known in advance. A rate of 1e4 makes
    # the gradient norm non-finite at once: TrainingDiverged, no rollback.
    space = tmp_path / "space.yaml"
    space.write_text(
        "study: {metric: eval/acc, pruner: none, sampler: random, seed: 0, "
        "max_consecutive_failures: 5}\n"
        "params:\n"
        "  optimizer.lr: {type: categorical, choices: [0.01, 10000.0]}\n"
    )
    out = tmp_path / "tune"
    short = [*SETS, "training.max_steps=20"]
    rc, stdout, stderr = _run(ray_cluster, _args(ray_cluster, space, out, trials=3, sets=short))
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    rows = _table((out / "summary.md").read_text())
    failed = [r for r in rows if r["state"] == "fail"]
    assert failed, rows  # the seed draws 1e4 at least once (else this test proves nothing)
    # Failed trials do not count toward --trials 3: as many others replaced them.
    assert sorted(r["state"] for r in rows if r not in failed) == ["complete"] * 3, rows
    for r in rows:
        assert (r in failed) == ("optimizer.lr=1e+04" in r["params"]), r
    for r in failed:
        assert r["error"].startswith("TrainingDiverged: non-finite"), r
    best = load_config(out / "best_config.yaml")
    assert best.optimizer.lr == 0.01

    # Every trial fails: after 2 in a row no new one starts, exit 1, nothing completed.
    doomed = tmp_path / "doomed.yaml"
    doomed.write_text(
        "study: {metric: eval/acc, pruner: none, max_consecutive_failures: 2}\n"
        "params:\n"
        "  optimizer.lr: {type: categorical, choices: [10000.0]}\n"
    )
    out2 = tmp_path / "doomed"
    rc, stdout, stderr = _run(ray_cluster, _args(ray_cluster, doomed, out2, trials=4, sets=short))
    assert rc == 1, stdout[-3000:] + stderr[-3000:]
    assert "stopped after 2 failed trials in a row" in stderr
    assert "no trial completed" in stderr
    rows = _table((out2 / "summary.md").read_text())
    # Two trials run at once: the one running when the second failure came also finishes.
    assert 2 <= len(rows) <= 3 and all(r["state"] == "fail" for r in rows), rows


def _experiment_trials(out: Path) -> list[tuple[str, dict]]:
    """(status, last result) of each trial in the newest saved experiment state."""
    states = sorted(out.glob("ray/digits/experiment_state-*.json"))
    if not states:
        return []
    try:
        data = json.loads(states[-1].read_text())
    except (OSError, ValueError):  # being replaced right now
        return []
    return [
        (json.loads(t)["status"], json.loads(m).get("last_result", {}) if isinstance(m, str)
         else m.get("last_result", {}))
        for t, m in data["trial_data"]
    ]  # fmt: skip


def _just_after_a_save(out: Path, deadline: float, quiet_s: float = 0.3) -> None:
    """Return once Ray has copied the experiment's state into ``out`` and gone quiet: it
    copies it from the driver's staging folder every 2 s, and a driver killed inside a copy
    leaves a truncated file no restore can read (Ray's copy is not atomic; documented). A
    kill just after one copy is far from the next."""
    exp = out / "ray" / "digits"

    def stamp() -> dict[str, int]:
        try:
            return {p.name: p.stat().st_mtime_ns for p in exp.iterdir() if p.is_file()}
        except OSError:  # not there yet, or a file replaced while listed
            return {}

    before = stamp()
    while (now := stamp()) == before and time.monotonic() < deadline:
        time.sleep(0.05)  # wait for a copy to land
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        settled = stamp()
        if settled == now:
            return
        now = settled


def test_a_killed_driver_is_restored_without_rerunning_finished_trials(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(
        "study: {metric: eval/acc, pruner: none, sampler: random, seed: 0}\n"
        "params:\n"
        "  optimizer.lr: {type: float, low: 1.0e-3, high: 3.0e-2, log: true}\n"
    )
    out = tmp_path / "tune"
    # Long enough, and trials enough, that the saved experiment state (every 2 s) holds a
    # finished trial beside a running one that reported a checkpoint on a loaded host too:
    # with 4 trials of 250 steps a clean-clone run saw the search end first.
    long = [*SETS, "training.max_steps=400"]
    args = _args(ray_cluster, space, out, trials=6, sets=long)
    driver = subprocess.Popen(
        [sys.executable, "-m", "hpc_core.cli", *args],
        env=ray_cluster["env"],  # type: ignore[arg-type]
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Kill it once the saved state holds a finished trial and a running one that has
        # reported two checkpoints. Ray records a reported checkpoint as the trial's only
        # when the trial's "save" task comes back, after the result itself: a state saved in
        # between has the result's checkpoint_dir_name but no checkpoint to restore from (a
        # clean-clone run killed it there and the trial restarted at step 0). That save
        # comes back before the next result, so with a second one the first is recorded.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            _just_after_a_save(out, deadline)
            trials = _experiment_trials(out)
            done = [r for s, r in trials if s == "TERMINATED"]
            running = [r for s, r in trials if s == "RUNNING" and r.get("checkpoint_dir_name")
                       and r.get("step", 0) >= 20]
            if done and running:
                break
            assert driver.poll() is None, "the search ended before it could be interrupted"
            time.sleep(0.2)
        else:
            pytest.fail(f"no finished and running trial together: {trials}")
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    finished = {r["config"]["trial_number"] for r in done}
    interrupted = {r["config"]["trial_number"]: r["step"] for r in running}
    before = {n: (out / f"trial_{n:04d}/metrics.jsonl").read_bytes() for n in finished}
    time.sleep(3)  # Ray ends the dead driver's trials

    rc, stdout, stderr = _run(ray_cluster, args)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    assert "restoring the ray experiment" in stderr
    rows = _table((out / "summary.md").read_text())
    assert [r["state"] for r in rows] == ["complete"] * 6, rows
    # The finished trials did not run again: their runs' records are as they were.
    for n in finished:
        assert (out / f"trial_{n:04d}/metrics.jsonl").read_bytes() == before[n], n
    # The interrupted trials resumed from a checkpoint they had reported (the saved state's
    # last result may be newer than its last checkpoint)...
    results = {
        json.loads(line)["config"]["trial_number"]: json.loads(line)
        for f in out.glob("ray/digits/*/result.json")
        for line in f.read_text().splitlines()[-1:]
    }
    for n, step in interrupted.items():
        assert 0 < results[n]["start_step"] <= step, (n, step, results[n])
        assert results[n]["start_step"] % 10 == 0  # an evaluation's checkpoint
    # ... exactly: the resumed run ends where an uninterrupted one of its config ends.
    from hpc_core.trainer import Trainer
    from hpc_core.tune.trial import trial_config

    n = min(interrupted)
    base = load_config(REPO / "configs/digits.yaml", long)
    params = {"optimizer.lr": results[n]["config"]["optimizer.lr"]}
    cfg = trial_config(base, params, tmp_path / "fresh", n)
    fresh = Trainer(cfg).train()
    assert results[n]["eval/acc"] == fresh.metrics["eval/acc"]
    assert results[n]["eval/loss"] == fresh.metrics["eval/loss"]


def test_asha_max_t_is_the_real_step_count() -> None:
    base = load_config(REPO / "configs/digits.yaml")  # 12 epochs x 22 steps of 64 of 1,438
    assert asha_max_t(base, load_space(REPO / "configs/space_digits.yaml")) == 264
    # A space that tunes the step count: its longest trial (most epochs, smallest batch).
    tuned = SearchSpace.model_validate(
        {
            "params": {
                "training.epochs": {"type": "int", "low": 2, "high": 20},
                "training.global_batch_size": {"type": "categorical", "choices": [128, 64]},
                "optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
            }
        }
    )
    assert asha_max_t(base, tuned) == 20 * 22


def test_a_trial_the_scheduler_stopped_is_pruned_to_the_sampler() -> None:
    """Ray's OptunaSearch records a finished trial COMPLETE at its last score; a trial ASHA
    stopped at step 20 (a chance-level score in the warm-up) must reach TPE as PRUNED, as the
    Optuna backend records it, or TPE learns that its parameters are bad."""
    from ray.tune.search.optuna import OptunaSearch

    from hpc_core.tune.ray_backend import TrialBudget
    from hpc_core.tune.search_space import distributions
    from hpc_core.tune.worker import make_sampler

    space = load_space(REPO / "configs/space_digits.yaml")
    search = OptunaSearch(space=distributions(space), metric="eval/acc", mode="max",
                          sampler=make_sampler(space, 0))
    budget = TrialBudget(search, trials=3, max_consecutive_failures=3)
    for tid in ("a", "b", "c"):
        assert isinstance(budget.suggest(tid), dict)
        budget.on_trial_result(tid, {"eval/acc": 0.1, "training_iteration": 1, "step": 20})
    budget.on_trial_complete("a", {"eval/acc": 0.1, "step": 20})  # stopped by ASHA
    budget.on_trial_complete("b", {"eval/acc": 0.97, "step": 264, "final": True})
    budget.on_trial_complete("c", None, error=True)
    trials = search._ot_study.get_trials(deepcopy=False)
    assert [t.state.name for t in trials] == ["PRUNED", "COMPLETE", "FAIL"]
    assert trials[1].value == 0.97 and trials[0].intermediate_values == {1: 0.1}


def test_storage_is_the_optuna_backends(tmp_path: Path, capsys) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  optimizer.lr: {type: float, low: 1.0e-3, high: 1.0e-1}\n")
    args = ["tune", "--backend", "ray", "--config", str(REPO / "configs/digits.yaml")]
    args += ["--space", str(space), "--trials", "2", "--out", str(tmp_path / "out")]
    assert main([*args, "--storage", "sqlite:///x.db"]) == 2
    assert "--storage is the optuna backend's" in capsys.readouterr().err


def test_a_trial_waits_for_an_earlier_run_of_itself_to_end(tmp_path: Path) -> None:
    from hpc_core.tune.ray_trial import _sole_run

    folder = tmp_path / "trial_0002"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from hpc_core.tune.ray_trial import _sole_run\n"
         "with _sole_run(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="another run of this trial"), \
                _sole_run(folder, wait_s=0.5):
            pass
        holder.kill()  # the earlier run ends (killed, as Ray ends a dead driver's trials)
        holder.wait()
        with _sole_run(folder, wait_s=5):
            pass
    finally:
        holder.kill()
        holder.wait()
