"""hpc-train tune: a real Optuna study of real digits runs, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from hpc_core.cli import main  # noqa: E402
from hpc_core.config import load_config  # noqa: E402
from hpc_core.tune.report import summary_markdown  # noqa: E402
from hpc_core.tune.search_space import SearchSpace, load_space  # noqa: E402
from hpc_core.tune.storage import make_storage  # noqa: E402
from hpc_core.tune.worker import hyperband_max_resource, run_worker  # noqa: E402

REPO = Path(__file__).resolve().parents[3]

# Small and short: 60 steps of a narrow CNN on 8x8 digits, evaluated every 10 steps. The LR
# range spans rates that learn and rates that do not, so the median pruner has work to do.
SPACE = """\
study: {metric: eval/acc, pruner: median, n_startup_trials: 2, n_warmup_steps: 0, seed: 0}
params:
  optimizer.lr: {type: float, low: 1.0e-5, high: 1.0, log: true}
  model.kwargs.width: {type: categorical, choices: [4, 8]}
"""
SETS = [
    "training.epochs=null",
    "training.max_steps=60",
    "training.eval_every_steps=10",
    "model.kwargs.norm=none",
    "checkpoint.best_metric=null",
    "data.image_size=8",
]


def _args(space: Path, out: Path, storage: str | None = None, trials: int = 6) -> list[str]:
    args = ["--config", str(REPO / "configs/digits.yaml"), "--space", str(space)]
    args += ["--trials", str(trials), "--out", str(out), "--log-format", "json"]
    if storage:
        args += ["--storage", storage]
    for s in SETS:
        args += ["--set", s]
    return args


@pytest.fixture
def space(tmp_path: Path) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(SPACE)
    return p


def _trials(storage: str, name: str = "digits") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=make_storage(storage)).get_trials()


def test_study_with_pruning_and_best_config_retrains(tmp_path: Path, space: Path, capsys) -> None:
    out = tmp_path / "tune"
    assert main(["tune", *_args(space, out), "--worker-index", "0"]) == 0
    trials = _trials(f"sqlite:///{out}/study.db")
    states = [t.state for t in trials]
    assert len(trials) == 6
    assert states.count(optuna.trial.TrialState.PRUNED) >= 1, capsys.readouterr().out
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 2
    # A pruned trial stopped early, at a step it reported.
    for t in trials:
        if t.state == optuna.trial.TrialState.PRUNED:
            assert t.user_attrs["steps"] < 60 and t.user_attrs["steps"] in t.intermediate_values
    assert (out / "history.png").stat().st_size > 1000
    summary = (out / "summary.md").read_text()
    assert summary.count("| pruned |") == states.count(optuna.trial.TrialState.PRUNED)
    # The best config is a valid config that trains to the best trial's value (same seed).
    best = max((t for t in trials if t.value is not None), key=lambda t: t.value)
    cfg = load_config(out / "best_config.yaml")
    assert cfg.optimizer.lr == pytest.approx(best.params["optimizer.lr"])
    assert cfg.model.kwargs["width"] == best.params["model.kwargs.width"]
    from hpc_core.trainer import Trainer

    result = Trainer(cfg).train()
    assert result.metrics["eval/acc"] == pytest.approx(best.value, abs=1e-9)


def _two_workers(space: Path, out: Path, storage: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "hpc_core.cli", "tune", *_args(space, out, storage)]
    procs = [
        subprocess.Popen(
            [*cmd, "--worker-index", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _assert_split(trials: list[optuna.trial.FrozenTrial], out: Path) -> None:
    counted = [t for t in trials if t.number < 6]
    assert sorted(t.number for t in counted) == list(range(6))
    done = {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}
    assert all(t.state in done for t in counted), [t.state for t in counted]
    workers = {t.user_attrs["worker"] for t in counted}
    assert len(workers) == 2, workers  # both workers took trials
    # No trial ran twice: each has its own run folder with one contiguous stream of steps, and
    # no two trials drew the same learning rate.
    for t in counted:
        lines = (out / f"trial_{t.number:04d}" / "metrics.jsonl").read_text().splitlines()
        steps = [int(line.split('"step": ')[1].split(",")[0]) for line in lines]
        assert steps == sorted(steps), f"trial {t.number} was written by two runs"
    lrs = [t.params["optimizer.lr"] for t in counted]
    assert len(set(lrs)) == len(lrs)


def test_two_workers_share_a_sqlite_study(tmp_path: Path, space: Path, subprocess_env) -> None:
    out = tmp_path / "tune"
    storage = f"sqlite:///{tmp_path}/shared.db"
    _two_workers(space, out, storage, subprocess_env)
    _assert_split(_trials(storage), out)


# A worker reduced to its start: open the storage, join the study, run one instant trial. It
# waits on stdin before each round, so every worker opens the same fresh database at once.
_STARTING_WORKER = """
import sys

import optuna

from hpc_core.tune.storage import make_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)
print("ready", flush=True)
for url in sys.argv[1:]:
    sys.stdin.readline()
    study = optuna.create_study(study_name="race", storage=make_storage(url), load_if_exists=True)
    trial = study.ask()
    study.tell(trial, float(trial.number))
    print("joined", flush=True)
"""


def _start_together(urls: list[str], env: dict[str, str], workers: int = 4) -> None:
    """``workers`` processes open each of ``urls`` (fresh databases) at the same instant; every
    one must join every study, and each study must hold one complete trial per worker."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STARTING_WORKER, *urls],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(workers)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n", p.stderr
        for round_, url in enumerate(urls):
            # Release all workers together: each blocks on its stdin until this line.
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            for i, p in enumerate(procs):
                assert p.stdout is not None
                line = p.stdout.readline()
                if line != "joined\n":
                    p.kill()
                    err = p.communicate(timeout=30)[1]
                    pytest.fail(f"worker {i} did not join fresh study {round_}:\n{err[-3000:]}")
            trials = _trials(url, "race")
            assert sorted(t.number for t in trials) == list(range(workers)), round_
            assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), round_
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_workers_starting_at_once_all_join_a_fresh_sqlite_study(
    tmp_path: Path, subprocess_env
) -> None:
    # Each round is a fresh database: the race is in creating the schema and stamping its
    # version, so only a first open can lose it.
    _start_together([f"sqlite:///{tmp_path}/fresh{r}.db" for r in range(5)], subprocess_env)


def test_two_workers_share_a_postgresql_study(
    tmp_path: Path, space: Path, subprocess_env, postgres_url: str
) -> None:
    pytest.importorskip("psycopg2")
    out = tmp_path / "tune"
    _two_workers(space, out, postgres_url, subprocess_env)
    _assert_split(_trials(postgres_url), out)


def test_workers_starting_at_once_all_join_a_fresh_postgresql_study(
    subprocess_env, postgres_url: str
) -> None:
    psycopg2 = pytest.importorskip("psycopg2")
    base, _, _ = postgres_url.rpartition("/")
    conn = psycopg2.connect(postgres_url)
    conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    try:
        with conn.cursor() as cur:
            for r in range(3):
                cur.execute(f"CREATE DATABASE fresh{r}")
    finally:
        conn.close()
    _start_together([f"{base}/fresh{r}" for r in range(3)], subprocess_env)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("params:\n  optimizer.lr: {type: float, low: 0.1, high: 0.01}\n", "low (0.1) must be"),
        ("params:\n  optimizer.lr: {type: float, low: 0, high: 1, log: true}\n", "log=true needs"),
        (
            "params:\n  optimizer.lr: {type: float, low: 0.1, high: 1, lg: true}\n",
            "lg: unknown key",
        ),
        ("params:\n  optimizer.rate: {type: int, low: 1, high: 2}\n", "no key 'rate'"),
        ("params:\n  optimizer: {type: int, low: 1, high: 2}\n", "names a section"),
        ("stduy: {}\nparams:\n  optimizer.lr: {type: categorical, choices: [1]}\n", "stduy"),
        ("params: {}\n", "params"),
    ],
)
def test_space_file_errors_exit_2_naming_the_path(
    tmp_path: Path, text: str, expected: str, capsys
) -> None:
    bad = tmp_path / "space.yaml"
    bad.write_text(text)
    assert main(["tune", *_args(bad, tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err, err
    assert not (tmp_path / "out").exists()


def test_example_space_file_is_valid() -> None:
    space = load_space(REPO / "configs/space_digits.yaml")
    assert "optimizer.lr" in space.params


# Trials of 20 steps, evaluated every 10: failures are the subject here, not the search.
SHORT = [*SETS, "training.max_steps=20"]


def _short_args(space: Path, out: Path, trials: int) -> list[str]:
    args = ["tune", "--config", str(REPO / "configs/digits.yaml"), "--space", str(space)]
    args += ["--trials", str(trials), "--out", str(out), "--log-format", "json"]
    args += ["--worker-index", "0"]
    for s in SHORT:
        args += ["--set", s]
    return args


def _space(tmp_path: Path, name: str, study: str) -> Path:
    p = tmp_path / name
    p.write_text(
        f"study: {{seed: 0, n_startup_trials: 2, {study}}}\n"
        "params:\n"
        "  optimizer.lr: {type: float, low: 1.0e-3, high: 3.0e-2, log: true}\n"
        "  model.kwargs.width: {type: categorical, choices: [4, 8]}\n"
    )
    return p


def test_diverging_and_mistyped_metric_trials_fail_and_others_complete(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "tune"
    url = f"sqlite:///{out}/study.db"
    # A worker started with a mistyped metric: its trial fails at the first evaluation (step 10,
    # not after the whole run), and with max_consecutive_failures=1 the worker stops.
    typo = _space(tmp_path, "typo.yaml", "metric: eval/accuracy, max_consecutive_failures: 1")
    assert main(_short_args(typo, out, trials=3)) == 1
    err = capsys.readouterr().err
    assert "stopped after 1 failed trials in a row" in err
    assert "trials still running" not in err
    (typo_trial,) = _trials(url)
    assert typo_trial.state == optuna.trial.TrialState.FAIL
    assert typo_trial.user_attrs["error"] == (
        "MetricNotReported: study.metric 'eval/accuracy' is not reported by the evaluation at "
        "step 10 (it reports eval/acc, eval/loss): fix study.metric in the space file"
    )
    assert typo_trial.user_attrs["steps"] == 10

    # The next trial of the study diverges: lr 1e4 makes the gradient norm non-finite.
    study = optuna.load_study(study_name="digits", storage=make_storage(url))
    with pytest.warns(UserWarning, match="out of range"):  # the space stops at 3e-2
        study.enqueue_trial({"optimizer.lr": 1.0e4, "model.kwargs.width": 4})
        good = _space(tmp_path, "good.yaml", "metric: eval/acc")
        assert main(_short_args(good, out, trials=3)) == 0
    captured = capsys.readouterr()
    trials = _trials(url)
    states = [t.state for t in trials]
    FAIL = optuna.trial.TrialState.FAIL
    # Failed trials do not count toward --trials 3: the worker ran three more after them.
    assert [s == FAIL for s in states] == [True, True, False, False, False], states
    assert all(t.user_attrs["steps"] == 20 or t.state.name == "PRUNED" for t in trials[2:])
    diverged = trials[1]
    assert diverged.params["optimizer.lr"] == 1.0e4
    assert diverged.user_attrs["error"].startswith("TrainingDiverged: non-finite")
    assert diverged.user_attrs["steps"] < 20
    # The error and its traceback are in the worker's log (JSON lines on stderr).
    logged = [json.loads(line) for line in captured.err.splitlines() if line.startswith("{")]
    (entry,) = [r for r in logged if r["msg"].startswith("trial 1 failed")]
    assert entry["level"] == "error" and "TrainingDiverged" in entry["exc"]
    summary = (out / "summary.md").read_text()
    done = re.match(r"(\d) complete, (\d) pruned, 2 fail, 0 running", summary)
    assert done and int(done[1]) + int(done[2]) == 3, summary
    assert "MetricNotReported: study.metric 'eval/accuracy'" in summary
    assert "TrainingDiverged: non-finite" in summary
    best = load_config(out / "best_config.yaml")
    assert best.optimizer.lr < 1.0


def test_a_sigterm_during_a_trial_fails_it_and_stops_the_worker(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("HPC_FAULT_SIGTERM_STEP", "3")  # what a preempted worker receives
    out = tmp_path / "tune"
    space = _space(tmp_path, "space.yaml", "metric: eval/acc")
    assert main(_short_args(space, out, trials=3)) == 1  # nothing completed
    (trial,) = _trials(f"sqlite:///{out}/study.db")
    assert trial.state == optuna.trial.TrialState.FAIL
    assert trial.user_attrs["error"] == "interrupted: SIGTERM at step 3"
    # It was this worker's only trial and it no longer runs: the reports are written.
    assert "| fail |" in (out / "summary.md").read_text()
    assert "no trial completed" in capsys.readouterr().err


def test_summary_waits_for_trials_running_elsewhere(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tune"
    url = f"sqlite:///{out}/study.db"
    space = _space(tmp_path, "space.yaml", "metric: eval/acc, heartbeat_s: null")
    out.mkdir()
    # Another worker's trial, still running while this worker finishes its own.
    study = optuna.create_study(
        study_name="digits", storage=make_storage(url), direction="maximize"
    )
    elsewhere = study.ask()
    assert main(_short_args(space, out, trials=2)) == 0
    assert "trials still running in other workers" in capsys.readouterr().err
    assert not (out / "summary.md").exists() and not (out / "best_config.yaml").exists()
    study.tell(elsewhere, 0.0)
    # The last worker to finish (here: one that finds nothing left to run) writes them once.
    assert main(_short_args(space, out, trials=2)) == 0
    assert (out / "summary.md").read_text().startswith("2 complete, 0 pruned, 0 fail, 0 running")


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_killed_workers_trial_is_failed_by_its_stale_heartbeat(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    url = f"sqlite:///{out}/study.db"
    out.mkdir()
    study = optuna.create_study(
        study_name="digits", storage=make_storage(url, heartbeat_s=1), direction="maximize"
    )
    # A trial whose worker died: one heartbeat, then silence past the grace period (2 beats).
    # 3.5 s, not 2.5: SQLite's CURRENT_TIMESTAMP, which the staleness check compares against,
    # has whole seconds, so 2.5 s after a beat can still read as under 2 s.
    dead = study.ask()
    study._storage.record_heartbeat(dead._trial_id)
    time.sleep(3.5)
    space = _space(tmp_path, "space.yaml", "metric: eval/acc, heartbeat_s: 1")
    base = load_config(REPO / "configs/digits.yaml", SHORT)
    result = run_worker(base, load_space(space), trials=1, storage=url, out=out)
    assert result.stopped == "done" and result.finished
    states = [t.state.name for t in result.study.get_trials()]
    assert states == ["FAIL", "COMPLETE"], states
    assert "no heartbeat: its worker died" in summary_markdown(result.study, "eval/acc")


def test_hyperband_max_resource_is_the_real_step_count() -> None:
    base = load_config(REPO / "configs/digits.yaml")  # 12 epochs x 22 steps of 64 of 1,438
    space = load_space(REPO / "configs/space_digits.yaml")
    # 6 brackets (floor(log3(264)) + 1) where the old guess of 10**6 steps made 13.
    assert hyperband_max_resource(base, space) == 264
    # A space that changes the step count from trial to trial: Optuna takes the first
    # finished trial's.
    epochs = SearchSpace.model_validate(
        {"params": {"training.epochs": {"type": "int", "low": 2, "high": 12}}}
    )
    assert hyperband_max_resource(base, epochs) == "auto"


def test_ray_backend_without_ray_says_how_to_install_it(
    tmp_path: Path, space: Path, monkeypatch, capsys
) -> None:
    # As if the ray extra were not installed: importing ray fails.
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "hpc_core.tune.ray_backend", raising=False)
    assert main(["tune", *_args(space, tmp_path / "out"), "--backend", "ray"]) == 2
    assert "pip install 'edgetrain[ray]'" in capsys.readouterr().err
