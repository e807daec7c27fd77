"""hpc-train tune: a real Optuna study of real digits runs, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from hpc_core.cli import main  # noqa: E402
from hpc_core.config import load_config  # noqa: E402
from hpc_core.search_space import load_space  # noqa: E402
from hpc_core.tune import make_storage  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

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

from hpc_core.tune import make_storage

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on a free loopback port, stopped afterwards."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb")]
    if not found or found[-1] is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    bindir = Path(found[-1]).parent
    as_user: list[str] = []
    if os.geteuid() == 0:
        # initdb refuses to run as root: run the server as the postgres system user.
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: cannot start PostgreSQL")
        as_user = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="pg-"))
    if as_user:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", _free_port()
    ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run(
            [*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
             "--no-sync"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        start = subprocess.run(
            [*ctl, "-o", opts, "-l", str(root / "server.log"), "-w", "-t", "60", "start"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        if start.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            pytest.skip(f"PostgreSQL did not start: {start.stderr.strip()} {log[-500:]}")
        try:
            subprocess.run(
                [*as_user, str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port),
                 "-U", "postgres", "optuna"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            yield f"postgresql://postgres@127.0.0.1:{port}/optuna"
        finally:
            subprocess.run([*ctl, "-m", "immediate", "-w", "stop"], capture_output=True, timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
