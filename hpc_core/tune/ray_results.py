"""The trials of an ``hpc-train tune --backend ray`` experiment as an Optuna study
(``results_study``), so that the Optuna backend's report writer serves both backends.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from hpc_core.config import TrainConfig
from hpc_core.tune.ray_trial import TRIAL_KEY
from hpc_core.tune.search_space import SearchSpace, distributions
from hpc_core.tune.trial import trial_config

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`




def results_study(
    grid: Any, base: TrainConfig, space: SearchSpace, out: Path, name: str
) -> Any:
    """An in-memory Optuna study holding the experiment's trials (complete: finished its run;
    pruned: stopped by the scheduler; fail: raised), each with the user attributes the
    Optuna backend records, so ``summary_markdown`` and ``write_reports`` serve both."""
    import optuna
    from optuna.trial import TrialState

    metric = space.study.metric
    dists = distributions(space)
    rows = []
    for result in grid:
        config = dict(result.config or {})
        if TRIAL_KEY not in config:
            continue
        number = int(config.pop(TRIAL_KEY))
        last = result.metrics or {}
        attrs: dict[str, Any] = {
            "worker": last.get("worker", ""),
            "steps": last.get("step", ""),
            "seconds": round(float(last["time_total_s"]), 3) if "time_total_s" in last else "",
        }
        value = None
        if result.error is not None:
            state = TrialState.FAIL
            attrs["error"] = error_text(result.error)
        elif last.get("final"):
            state = TrialState.COMPLETE
            value = float(last[metric])
            attrs["config"] = trial_config(base, config, out, number).to_dict()
        else:
            state = TrialState.PRUNED
        intermediate: dict[int, float] = {}
        frame = result.metrics_dataframe
        if frame is not None and metric in frame and "step" in frame:
            for step, v in zip(frame["step"], frame[metric], strict=True):
                if not math.isnan(float(step)):
                    intermediate[int(step)] = float(v)
        rows.append((number, state, value, config, attrs, intermediate))
    study = optuna.create_study(study_name=name, direction=space.study.direction)
    for number, state, value, params, attrs, intermediate in sorted(rows, key=lambda r: r[0]):
        known = {k: v for k, v in params.items() if k in dists}
        study.add_trial(
            optuna.trial.create_trial(
                state=state,
                value=value,
                params=known,
                distributions={k: dists[k] for k in known},
                user_attrs=attrs,
                intermediate_values=intermediate,
            )
        )
        if study.trials[-1].number != number:
            log.warning("trial %d is listed as %d", number, study.trials[-1].number)
    return study


def error_text(error: BaseException) -> str:
    """A failed trial's error as the Optuna backend records it: ``Type: message``."""
    cause: BaseException | None = error
    # Ray wraps what the trial raised (RayTaskError, TuneError); the original is its cause.
    while cause is not None:
        inner = getattr(cause, "cause", None) or cause.__cause__
        if inner is None or inner is cause:
            break
        cause = inner
    assert cause is not None
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text}"[:2000]
