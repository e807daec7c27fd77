"""hpc-train tune's tracking: one MLflow parent run per study, each trial's run nested under it,
with a real local MLflow store (SQLite) and a real Optuna study of real digits runs."""

from __future__ import annotations

from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
mlflow = pytest.importorskip("mlflow")

from hpc_core.cli import main  # noqa: E402
from hpc_core.config import load_config  # noqa: E402
from hpc_core.tune.storage import make_storage  # noqa: E402
from hpc_core.tune.study_run import open_study_run  # noqa: E402

REPO = Path(__file__).resolve().parents[3]

SETS = [
    "training.epochs=null",
    "training.max_steps=30",
    "training.eval_every_steps=10",
    "model.kwargs.norm=none",
    "checkpoint.best_metric=null",
    "data.image_size=8",
    "logging.mlflow=true",
]
# Rates that learn and rates that do not (the median pruner stops those), and one that diverges.
SPACE = """\
study: {metric: eval/acc, pruner: median, n_startup_trials: 2, n_warmup_steps: 0, seed: 0}
params:
  optimizer.lr: {type: float, low: 1.0e-5, high: 1.0, log: true}
  model.kwargs.width: {type: categorical, choices: [4, 8]}
"""


def _args(space: Path, out: Path, trials: int) -> list[str]:
    args = ["tune", "--config", str(REPO / "configs/digits.yaml"), "--space", str(space)]
    args += ["--trials", str(trials), "--out", str(out), "--worker-index", "0"]
    for s in SETS:
        args += ["--set", s]
    return args


def study_runs(out: Path, study: str = "digits") -> tuple[object, list[object]]:
    """The study's parent run and its nested runs, from the study's store ``OUT/mlflow.db``."""
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name("edgetrain")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("edgetrain.role") == "study"]
    assert len(parents) == 1, [(r.info.run_name, r.data.tags) for r in parents]
    (parent,) = parents
    assert parent.data.tags["edgetrain.study"] == study and parent.info.run_name == study
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    # Nothing else logged there: every other run is one of the study's trials.
    assert len(children) == len(runs) - 1
    return parent, children


def test_a_study_has_one_parent_run_and_each_trial_a_nested_run(
    tmp_path: Path, capsys
) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = tmp_path / "tune"
    out.mkdir()
    url = f"sqlite:///{out}/study.db"
    # Trial 0 diverges (lr 1e4 makes the loss non-finite): FAIL, replaced.
    study = optuna.create_study(study_name="digits", storage=make_storage(url),
                                direction="maximize")  # fmt: skip
    with pytest.warns(UserWarning, match="out of range"):
        study.enqueue_trial({"optimizer.lr": 1.0e4, "model.kwargs.width": 4})
        assert main(_args(space, out, trials=5)) == 0, capsys.readouterr().err[-3000:]
    trials = optuna.load_study(study_name="digits", storage=make_storage(url)).get_trials()
    states = {t.number: t.state.name for t in trials}
    assert states[0] == "FAIL" and len(states) == 6
    assert "PRUNED" in states.values() and "COMPLETE" in states.values(), states

    parent, children = study_runs(out)
    assert parent.info.status == "FINISHED"
    by_trial = {int(r.data.tags["edgetrain.trial"]): r for r in children}
    assert sorted(by_trial) == sorted(states) and len(children) == len(states)
    for number, run in by_trial.items():
        state = states[number]
        assert run.data.tags["edgetrain.study"] == "digits"
        assert run.data.tags["edgetrain.trial_state"] == state
        # A pruned trial ran as it should: FINISHED, its state in the tag; a failed one FAILED.
        assert run.info.status == ("FAILED" if state == "FAIL" else "FINISHED"), (number, state)
        assert run.info.run_name == f"digits-trial{number}"
    assert "non-finite" in by_trial[0].data.tags["error"]
    # The parent records the best trial.
    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert parent.data.metrics["best/eval/acc"] == pytest.approx(best.value)
    assert parent.data.tags["best.trial"] == str(best.number)
    assert parent.data.tags["best.optimizer.lr"] == str(best.params["optimizer.lr"])
    assert parent.data.metrics["trials/complete"] == list(states.values()).count("COMPLETE")
    assert parent.data.metrics["trials/pruned"] == list(states.values()).count("PRUNED")
    assert parent.data.metrics["trials/fail"] == 1
    # The best config logs to the study's store, not one database per trial folder.
    cfg = load_config(out / "best_config.yaml")
    assert cfg.logging.mlflow_tracking_uri == f"sqlite:///{out.resolve()}/mlflow.db"

    # The study resumed with a larger budget: the same parent, running again, then finished.
    assert main(_args(space, out, trials=6)) == 0
    parent2, children2 = study_runs(out)
    assert parent2.info.run_id == parent.info.run_id and parent2.info.status == "FINISHED"
    assert len(children2) == 7
    assert parent2.data.metrics["trials/complete"] + parent2.data.metrics["trials/pruned"] == 6


def test_workers_of_a_study_share_its_parent_run(make_config, tmp_path: Path) -> None:
    """Every worker opening a study gets its one parent run (found by its tags, created by
    the first), and another study gets its own."""
    base = make_config("digits", ["logging.mlflow=true"])
    out = tmp_path / "tune"
    first = open_study_run(base, out, "alpha")
    assert first is not None
    again = open_study_run(base, out, "alpha")
    other = open_study_run(base, out, "beta")
    assert again is not None and other is not None
    assert again.run_id == first.run_id and other.run_id != first.run_id
    client = mlflow.tracking.MlflowClient(tracking_uri=first.tracking_uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    # Off when the config logs no MLflow.
    assert open_study_run(make_config("digits", []), out, "alpha") is None


def test_a_trials_wandb_run_has_its_study_as_group(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))  # nothing written to $HOME
    from hpc_core.config import WandbConfig
    from hpc_core.tracking import TrialTracking, WandbSink, trial_tracking

    with trial_tracking(TrialTracking("alpha", 3)):
        sink = WandbSink(tmp_path / "trial", WandbConfig(), "digits-trial3", {})
    try:
        assert sink.run.group == "alpha" and sink.run.job_type == "trial"
    finally:
        sink.run.finish()
    # Outside a study: no group.
    alone = WandbSink(tmp_path / "run", WandbConfig(), "digits", {})
    try:
        assert not alone.run.group
    finally:
        alone.run.finish()
