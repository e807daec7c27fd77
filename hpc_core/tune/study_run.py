"""The study's parent tracking run of ``hpc-train tune`` (both backends).

MLflow: one run per study, named for it and tagged ``edgetrain.study=<name>`` and
``edgetrain.role=study``, in the trials' experiment; each trial's run is nested under it
(``mlflow.parentRunId``). Workers of one study (the Optuna backend's, on any machine) find it by
those tags and create it only when missing; a resumed study reuses it. When the study ends
(``close_study_run``) the parent records the best trial (``best/<metric>``, the best trial's
number and parameters as ``best.*`` tags, which a resumed study may change) and the trial counts,
every trial's run is set to how its trial ended (COMPLETE and PRUNED: FINISHED, tagged
``edgetrain.trial_state``; FAIL: FAILED), a run left RUNNING by a trial that was stopped while
it closed (or by an earlier attempt of a resumed trial) included, and the parent ends FINISHED.

W&B: the study is the trials' runs' ``group`` (``hpc_core.tracking.WandbSink``).

Without ``logging.mlflow`` nothing here runs. The trials' default store is shared: a study's
trials log to ``OUT/mlflow.db`` (artefacts in ``OUT/mlartifacts``), not one database per
trial folder, unless ``logging.mlflow_tracking_uri`` names another.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_core.config import TrainConfig
from hpc_core.tracking import EXPERIMENT, STUDY_TAG, TRIAL_STATE_TAG, TRIAL_TAG, RunStatus

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`

ROLE_TAG = "edgetrain.role"
"""``study`` on a study's parent run."""


def study_tracking_uri(base: TrainConfig, out: Path) -> str:
    """Where the study and its trials log: the configured URI, else ``OUT/mlflow.db``."""
    return base.logging.mlflow_tracking_uri or f"sqlite:///{out.resolve()}/mlflow.db"


@dataclass
class StudyRun:
    """The study's MLflow parent run."""

    tracking_uri: str
    run_id: str
    study: str


def open_study_run(base: TrainConfig, out: Path, study: str) -> StudyRun | None:
    """Find the study's parent run (by its tags) or create it; set it RUNNING. None when the
    config logs no MLflow."""
    if not base.logging.mlflow:
        return None
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = study_tracking_uri(base, out)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        # The trials' experiment; artefacts of the default store beside its database, as
        # hpc_core.tracking's own default does.
        location = None
        if base.logging.mlflow_tracking_uri is None:
            location = (out.resolve() / "mlartifacts").as_uri()
        try:
            client.create_experiment(EXPERIMENT, artifact_location=location)
        except mlflow.exceptions.MlflowException:  # another worker created it first
            log.debug("experiment %s exists already", EXPERIMENT)
        experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    found = _parents(client, experiment.experiment_id, study)
    if not found:
        created = client.create_run(
            experiment.experiment_id,
            run_name=study,
            tags={STUDY_TAG: study, ROLE_TAG: "study"},
        )
        # Two workers starting together may both have created one: the oldest is the study's.
        found = _parents(client, experiment.experiment_id, study)
        for extra in found[1:]:
            if extra.info.run_id == created.info.run_id:
                client.delete_run(extra.info.run_id)
    parent = found[0]
    if parent.info.status != "RUNNING":
        client.update_run(parent.info.run_id, status="RUNNING")  # a resumed study
    log.info("mlflow: study %s is run %s in %s", study, parent.info.run_id, uri)
    return StudyRun(uri, parent.info.run_id, study)


def _parents(client: Any, experiment_id: str, study: str) -> list[Any]:
    quoted = study.replace("\\", "\\\\").replace("'", "\\'")
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{STUDY_TAG}` = '{quoted}' and tags.`{ROLE_TAG}` = 'study'",
    )
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


# MLflow's status for a run whose trial ended so (a pruned trial ran as it should).
_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED"}


def close_study_run(
    parent: StudyRun, study: Any, metric: str, status: RunStatus = "FINISHED"
) -> None:
    """Record the study's outcome on the parent, set each trial's run to how its trial ended,
    and end the parent with ``status`` (FAILED: stopped after too many failures in a row).
    ``study``: the Optuna study (either backend's)."""
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    client = MlflowClient(tracking_uri=parent.tracking_uri)
    trials = {t.number: t for t in study.trials}
    children = client.search_runs(
        [client.get_run(parent.run_id).info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}'",
    )
    latest: dict[int, Any] = {}
    for run in sorted(children, key=lambda r: (r.info.start_time, r.info.run_id)):
        number = run.data.tags.get(TRIAL_TAG)
        if number is None or not number.isdigit():
            continue
        earlier = latest.get(int(number))
        if earlier is not None and earlier.info.status == "RUNNING":
            # An attempt of the trial that a resumed attempt replaced (its process was killed).
            client.set_tag(earlier.info.run_id, "error", "interrupted: the trial was resumed")
            client.set_terminated(earlier.info.run_id, "KILLED")
        latest[int(number)] = run
    for number, run in latest.items():
        trial = trials.get(number)
        if trial is None or trial.state.name not in _STATUS:
            continue  # still running (another worker's), or unknown here
        state = trial.state.name
        if run.data.tags.get(TRIAL_STATE_TAG) != state:
            client.set_tag(run.info.run_id, TRIAL_STATE_TAG, state)
        if run.info.status != _STATUS[state]:
            if state == "FAIL" and trial.user_attrs.get("error"):
                client.set_tag(run.info.run_id, "error", str(trial.user_attrs["error"])[:5000])
            client.set_terminated(run.info.run_id, _STATUS[state])
    counts = {s: sum(t.state == s for t in study.trials)
              for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}  # fmt: skip
    now = int(time.time() * 1000)
    for s, n in counts.items():
        client.log_metric(parent.run_id, f"trials/{s.name.lower()}", n, timestamp=now)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        client.log_metric(parent.run_id, f"best/{metric}", float(best.value), timestamp=now)
        client.set_tag(parent.run_id, "best.trial", str(best.number))
        for name, value in best.params.items():
            client.set_tag(parent.run_id, f"best.{name}", str(value))
    client.set_terminated(parent.run_id, status)
