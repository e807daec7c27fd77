"""The upstream half of a round: ``hpc-train aggregate`` and ``hpc-train publish``, run as
child processes (the fleet imports nothing of ``hpc_core`` but its PNG plots), and
what the learn reads back from them: ``aggregate.json`` and ``gates.json``, the tools' own
reports.

A tool runs while the controller keeps driving rollouts: ``ToolRun`` starts it, ``poll`` is
asked every turn. It is tied to the controller (``fleet.learn.child``): a killed controller
leaves no tool behind, and each action is idempotent on a restart: an aggregate folder
appears complete or not at all (the tool renames it into place last); a publish started
again after a kill either publishes or is refused by the registry because the version is
there already (``fleet.learn.gates.publish_verdict``): versions are immutable, the tool never
overwrites. Which gates each publish sets is ``fleet.learn.gates``'s too.
(The fleet reads no manifest itself: verifying one needs ``registry.pull``, whose imports
reach into ``hpc_core``, which the import contract keeps out of ``fleet``.)

The command is ``$FLEETCTL_HPC_TRAIN`` (or ``--hpc-train``), default the ``hpc-train`` entry
point of this environment.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from fleet.learn.gates import device_gate_args, upstream_gate_args
from fleet.learn.plan import LearnPlan
from fleet.learn.store import Dropped, GateLine
from registry.errors import RegistryError
from registry.jsonsafe import loads_strict

HPC_TRAIN_ENV = "FLEETCTL_HPC_TRAIN"
AGGREGATE_REPORT = "aggregate.json"
GATES_REPORT = "gates.json"
MAX_REPORT_BYTES = 16 << 20
EXIT_CRASHED = 70
"""What ``ToolRun.poll`` reports for a tool that died of an uncaught exception (EX_SOFTWARE):
the learn stops with its traceback's tail instead of skipping the round."""
CHILD = str(Path(__file__).with_name("child.py"))
"""``fleet.learn.child``, the launcher that ties a tool to the controller."""


def hpc_train_command(text: str | None = None) -> list[str]:
    """The upstream tool's argv prefix: ``text`` (shell words), ``$FLEETCTL_HPC_TRAIN``, or
    this environment's ``hpc-train`` entry point (``-m hpc_core.cli`` where it has none, with
    ``-P`` from 3.11 on).

    The entry point first: ``python -m`` puts the working directory first on the module
    path, so a folder there named like a package (an operator's ``registry/``) would be
    imported in its place."""
    text = text if text is not None else os.environ.get(HPC_TRAIN_ENV)
    if text:
        return shlex.split(text)
    script = Path(sys.executable).parent / "hpc-train"
    if script.is_file():
        return [str(script)]
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "hpc_core.cli"]


class UpstreamError(Exception):
    """The tool or the registry said something a round cannot go on from: the learn stops
    with this message (``fleetctl learn resume`` once it is fixed)."""


# --- command lines ------------------------------------------------------------------------


def aggregate_argv(plan: LearnPlan, base: str, updates: list[str], out: Path, *,
                   targets: int | None = None) -> list[str]:
    """``targets``: the devices the learn targets, DP's expected weight unless the plan sets
    one (known before any round, never the count of uploads that arrived)."""
    argv = ["aggregate", "--registry", plan.registry, "--model", plan.model, "--base", base,
            "--strategy", plan.strategy, "--min-updates", str(plan.min_updates),
            "--max-staleness", str(plan.max_staleness), "--updates", ",".join(updates),
            "--trusted-keys", str(plan.trusted_keys), "--out", str(out)]
    if plan.trim is not None:
        argv += ["--trim", f"{plan.trim:g}"]
    if plan.krum_f is not None:
        argv += ["--krum-f", str(plan.krum_f)]
    if plan.krum_keep is not None:
        argv += ["--krum-keep", str(plan.krum_keep)]
    if plan.clip_norm is not None:
        clip = plan.clip_norm
        argv += ["--clip-norm", clip if isinstance(clip, str) else f"{clip:g}"]
    if plan.server_lr != 1.0:
        argv += ["--server-lr", f"{plan.server_lr:g}"]
    if plan.dp_noise_multiplier is not None:
        # The privacy cost composes over every release the learn makes: its rounds.
        weight = plan.dp_expected_weight or targets
        if weight is None:
            raise ValueError("DP's expected weight: set dp_expected_weight or pass targets")
        argv += ["--dp-noise-multiplier", f"{plan.dp_noise_multiplier:g}",
                 "--dp-delta", f"{plan.dp_delta:g}", "--dp-rounds", str(plan.rounds),
                 "--dp-expected-weight", f"{weight:g}"]
        if plan.dp_weight_cap is not None:
            argv += ["--dp-weight-cap", f"{plan.dp_weight_cap:g}"]
    return argv


def candidate_argv(plan: LearnPlan, agg: Path, version: str,
                   base_checkpoint: Path | None) -> list[str]:
    """Publish the aggregate for the devices to score, behind the upstream gate if set."""
    return [*_publish(plan, agg, version), *upstream_gate_args(plan, base_checkpoint)]


def release_argv(plan: LearnPlan, agg: Path, version: str, evals: Path) -> list[str]:
    """Publish the release behind the device gates (their figures signed into it)."""
    return [*_publish(plan, agg, version), "--device-evals", str(evals),
            *device_gate_args(plan)]


def _publish(plan: LearnPlan, agg: Path, version: str) -> list[str]:
    argv = ["publish", str(agg), "--registry", plan.registry, "--name", plan.model,
            "--version", version, "--sign-key", str(plan.sign_key)]
    # The report names each device's norm and its distance to the aggregate before the
    # noise: under DP it stays in the learn's folder (the manifest ties it by sha256), or
    # the release would carry what the noise hides.
    if plan.dp_noise_multiplier is None:
        argv += ["--artefact", str(agg / AGGREGATE_REPORT)]
    return argv


# --- running one -------------------------------------------------------------------------


class ToolRun:
    """One upstream command in a child process tied to this one, its output in ``log``."""

    def __init__(self, prefix: list[str], argv: list[str], log: Path) -> None:
        self.argv = [*prefix, *argv]
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.start = out.tell()  # the log is appended to across restarts: this run's part
            out.write(f"$ {shlex.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                # By path, not -m: see hpc_train_command (it imports the standard library only).
                [sys.executable, CHILD, str(os.getpid()), "--", *self.argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        """The exit code once it ended; EXIT_CRASHED for an uncaught exception (Python exits
        1 for one, the code the tools give a round's "too few updates")."""
        code = self.proc.poll()
        if code == 1 and self.crashed():
            return EXIT_CRASHED
        return code

    def crashed(self) -> bool:
        """This run's output holds a Python traceback."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.start)
                return b"Traceback (most recent call last):" in f.read()
        except OSError:
            return False

    def tail(self, lines: int = 6) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(x.strip() for x in text.splitlines()[-lines:] if x.strip())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- what the tools wrote ------------------------------------------------------------------


class _Skip(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: str
    reason: str


class _Group(BaseModel):
    model_config = ConfigDict(extra="ignore")
    versions: list[str]


class _Duplicates(BaseModel):
    model_config = ConfigDict(extra="ignore")
    groups: list[_Group] = []


class _AggregateReport(BaseModel):
    # The tool's report is wide (weights, norms, lineage, DP); the learn keeps these.
    model_config = ConfigDict(extra="ignore")
    combined: list[str]
    skipped: list[_Skip]
    duplicates: _Duplicates = _Duplicates()


@dataclass(frozen=True)
class AggregateResult:
    combined: list[str]
    skipped: list[Dropped]
    duplicates: list[list[str]]
    """Groups of near-identical updates under several keys the tool flagged."""


def read_aggregate(out: Path, device_of: dict[str, str]) -> AggregateResult | None:
    """The finished aggregate in ``out``; None while it is not there (the tool renames the
    whole folder into place last, so one that is there is complete)."""
    path = out / AGGREGATE_REPORT
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        rep = _AggregateReport.model_validate(loads_strict(raw, str(path),
                                                           max_bytes=MAX_REPORT_BYTES))
    except (ValidationError, RegistryError) as e:
        raise UpstreamError(f"{path}: not an aggregate report ({e})") from None
    skipped = [Dropped(version=s.version, device=device_of.get(s.version, "?"), reason=s.reason)
               for s in rep.skipped]
    return AggregateResult(rep.combined, skipped,
                           [g.versions for g in rep.duplicates.groups])


class _Gate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    flag: str
    passed: bool
    detail: str


class _GatesReport(BaseModel):
    model_config = ConfigDict(extra="ignore")
    passed: bool
    gates: list[_Gate]


def read_gates(agg: Path) -> list[GateLine]:
    """The gate lines of the last ``hpc-train publish`` of ``agg`` ([] when it set none)."""
    path = agg / GATES_REPORT
    if not path.is_file():
        return []
    try:
        rep = _GatesReport.model_validate(loads_strict(path.read_bytes(), str(path),
                                                       max_bytes=MAX_REPORT_BYTES))
    except (ValidationError, RegistryError) as e:
        raise UpstreamError(f"{path}: not a gate report ({e})") from None
    return [GateLine(flag=g.flag, passed=g.passed, detail=g.detail) for g in rep.gates]
