"""The gates a round's aggregate passes before it becomes a release, and what a publish
decided.

The gates are ``hpc-train publish``'s own (the fleet imports nothing of ``hpc_core``: the
tool runs as a child, ``fleet.learn.upstream``). The learn decides which gates each of its
two publishes sets, from its plan, and what the tool's answer means for the round:

- The candidate (``PREFIX-rK-candidate``, what the devices evaluate) is published behind the
  upstream gate when the plan sets ``max_upstream_drop``: its accuracy on the upstream
  held-out split may fall at most that many points below the base's
  (``upstream_gate_args``).
- The release (``PREFIX-rK``) is published behind the device gates, on the devices'
  evaluations of the candidate (``device_gate_args``): ``--min-devices`` always (a candidate
  no device scored is never released), ``--min-mean-gain`` (weighed by ``--gain-mean``) and
  ``--max-device-drop`` as the plan sets them (``LearnPlan`` needs one of the two).
- ``publish_verdict`` reads the tool's exit: published, or refused by a gate (exit
  ``EXIT_REFUSED_BY_GATES``, nothing published: the round keeps its base and records the
  failed gates, ``refusal_reason``), or the version is taken, or the tool failed (both stop
  the learn).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from fleet.learn.plan import LearnPlan
from fleet.learn.store import GateLine

EXIT_REFUSED_BY_GATES = 4
"""``hpc-train publish``: a gate failed, nothing published."""
EXIT_EXISTS = 2
"""``hpc-train publish``: refused, among other usage errors, when the version is in the
registry already (versions are immutable and never overwritten)."""

PublishVerdict = Literal["published", "refused", "taken", "failed"]


def upstream_gate_args(plan: LearnPlan, base_checkpoint: Path | None) -> list[str]:
    """The candidate's gate: ``--max-upstream-drop`` against the checkpoint the round's base
    was published from (and the data to score on: ``eval_config``); none without
    ``plan.max_upstream_drop``."""
    if plan.max_upstream_drop is None:
        return []
    assert base_checkpoint is not None
    args = ["--max-upstream-drop", f"{plan.max_upstream_drop:g}",
            "--base-checkpoint", str(base_checkpoint)]
    if plan.eval_config is not None:
        args += ["--eval-config", str(plan.eval_config)]
    return args


def device_gate_args(plan: LearnPlan) -> list[str]:
    """The release's gates on the devices' evaluations: ``--min-devices`` always, then
    ``--min-mean-gain`` (with ``--gain-mean``) and ``--max-device-drop`` when set."""
    args = ["--min-devices", str(plan.min_devices)]
    if plan.min_mean_gain is not None:
        args += ["--min-mean-gain", f"{plan.min_mean_gain:g}"]
        if plan.gain_mean is not None:
            args += ["--gain-mean", plan.gain_mean]
    if plan.max_device_drop is not None:
        args += ["--max-device-drop", f"{plan.max_device_drop:g}"]
    return args


def publish_verdict(code: int, output: str, model: str, version: str,
                    runs: int) -> PublishVerdict:
    """What one ``hpc-train publish`` of ``model@version`` decided, from its exit ``code``
    and the tail of its ``output``; ``runs``: how often this round started that publish.

    - ``published``: exit 0; or the registry refused the version as already there and the
      round had started this publish before (a restart: the earlier run got there).
    - ``taken``: refused as already there on the round's first run: someone else's version.
    - ``refused``: a gate failed (``EXIT_REFUSED_BY_GATES``), nothing was published.
    - ``failed``: anything else.
    """
    if code == 0:
        return "published"
    if code == EXIT_EXISTS and f"{model}@{version} already exists" in output:
        return "published" if runs > 1 else "taken"
    if code == EXIT_REFUSED_BY_GATES:
        return "refused"
    return "failed"


def refusal_reason(which: str, gates: Iterable[GateLine]) -> str:
    """The round's reason when ``which`` (``upstream gate``, ``device gates``) refused its
    candidate: each failed gate's flag and figures."""
    return f"{which}: " + "; ".join(f"{g.flag}: {g.detail}" for g in gates if not g.passed)
