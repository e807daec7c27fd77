"""Gates an aggregate must pass before ``hpc-train publish`` signs it as the next release.

Federated evaluation before publishing: the operator sets thresholds, publish works out the
figures and signs only when every gate holds. The figures come from two places:

- upstream: the base release and the aggregate scored on the upstream held-out split
  (``--max-upstream-drop``); the scoring needs torch and lives in ``hpc_core.evaluation.upstream``,
  handed in as a function, because this package is torch-free;
- devices: each device's accuracy of the base and of the aggregate on its own held-out data,
  collected by the operator into ``--device-evals FILE`` (``--min-mean-gain``,
  ``--max-device-drop``, ``--min-devices``; the file is ``hpc_core.aggregation.device_evals``).

Every gate's figures go to ``gates.json`` beside ``aggregate.json``; a failed gate is one line
naming its flag and its figures. Accuracy differences are in percentage points (pts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from hpc_core.aggregation.device_evals import DeviceEvals, GainMean, load_device_evals
from hpc_core.aggregation.output import REPORT_FILE
from hpc_core.aggregation.report import FORMAT as REPORT_FORMAT
from hpc_core.checkpoint_layout import CheckpointError, read_trainer_state, resolve_checkpoint
from hpc_core.config import ConfigError, DataConfig, config_from_dict, load_config
from registry.atomic import write_json_atomic
from registry.errors import MalformedJsonError, RefusedError, UsageError
from registry.jsonsafe import loads_strict
from registry.manifest import MAX_MANIFEST_BYTES, AggregateInfo, BaseRelease, Manifest, utc_now
from registry.names import manifest_key
from registry.safetensors_io import FileRange, read_safetensors_index
from registry.stores import RegistryStore
from registry.validation import format_errors

GATES_FILE = "gates.json"
_NAMED = 8
"""Devices named in a gate's line at most (gates.json lists every one)."""
FORMAT = "edgetrain.gates/1"
_TOLERANCE_PTS = 1e-9
"""Float noise allowed at a threshold: 100 * (0.91 - 0.88) is 3.0000000000000027, and a drop
of exactly --max-upstream-drop 3 must pass."""


class AggregateReport(BaseModel):
    """The part of ``aggregate.json`` publishing reads. Our own file, not user input: other
    keys are ignored so the report can grow (``hpc_core.aggregation.report``) without this."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    format: str
    model: str
    base: BaseRelease
    strategy: str
    combined: tuple[str, ...]

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        if v != REPORT_FORMAT:
            raise ValueError(f"format {v!r} is not {REPORT_FORMAT!r}")
        return v


@dataclass(frozen=True)
class Aggregate:
    """An ``hpc-train aggregate`` output folder, with its report."""

    folder: Path
    report: AggregateReport
    report_sha256: str

    @property
    def base_ref(self) -> str:
        return f"{self.report.model}@{self.report.base.version}"

    def lineage(self) -> AggregateInfo:
        r = self.report
        return AggregateInfo(base=r.base, combined=r.combined, strategy=r.strategy,
                             report_sha256=self.report_sha256)


def read_aggregate(folder: Path) -> Aggregate | None:
    """The aggregate in ``folder``; None when it holds no aggregate.json (a plain checkpoint)."""
    path = Path(folder) / REPORT_FILE
    if not path.is_file():
        return None
    data = path.read_bytes()
    try:
        report = AggregateReport.model_validate(loads_strict(data, str(path),
                                                             max_bytes=MAX_MANIFEST_BYTES))
        agg = Aggregate(Path(folder), report, hashlib.sha256(data).hexdigest())
        agg.lineage()  # what the manifest will carry must validate now, not after the gates
    except MalformedJsonError as e:
        raise UsageError(f"{e}: make the aggregate again with hpc-train aggregate") from None
    except ValidationError as e:
        lines = "\n".join(format_errors(e, AggregateReport))
        raise UsageError(f"{path} is not an hpc-train aggregate report:\n{lines}") from None
    return agg


def read_base(store: RegistryStore, agg: Aggregate) -> Manifest:
    """The aggregate's base release in ``store``, with the sequence the round verified.

    Read, not verified: the publisher already trusts its registry for the parent's sequence,
    and the round verified this very manifest (its sequence must match) before combining."""
    r = agg.report
    data = store.get(manifest_key(r.model, r.base.version), MAX_MANIFEST_BYTES)
    if data is None:
        raise UsageError(f"{agg.folder}/{REPORT_FILE}: base {agg.base_ref} is not in {store.uri}: "
                         "publish into the registry the round read (--registry)")
    try:
        base = Manifest.from_bytes(data, source=agg.base_ref)
    except RefusedError as e:
        raise UsageError(f"base {agg.base_ref} in {store.uri} is unreadable: {e}") from None
    if base.sequence != r.base.sequence:
        raise UsageError(
            f"{agg.folder}/{REPORT_FILE}: base {agg.base_ref} had sequence {r.base.sequence}, "
            f"{store.uri} holds sequence {base.sequence}: the round read another registry")
    return base


# -- settings and gates --------------------------------------------------------------------------


@dataclass(frozen=True)
class GateSettings:
    """The gate flags of ``hpc-train publish``, as given (None: not set)."""

    max_upstream_drop: float | None = None
    base_checkpoint: Path | None = None
    eval_config: Path | None = None
    device_evals: Path | None = None
    min_mean_gain: float | None = None
    max_device_drop: float | None = None
    min_devices: int | None = None
    gain_mean: GainMean | None = None
    dry_run: bool = False

    def given(self) -> list[str]:
        """Every gate flag set, as its option name."""
        return [f"--{name.replace('_', '-')}" for name, value in vars(self).items()
                if value not in (None, False)]

    @property
    def any_gate(self) -> bool:
        return self.max_upstream_drop is not None or self.device_gates

    @property
    def device_gates(self) -> bool:
        return any(v is not None for v in (self.min_mean_gain, self.max_device_drop,
                                            self.min_devices))

    def check(self, source: Path, is_aggregate: bool) -> None:
        """UsageError (exit 2) for flags that cannot go together or have nothing to gate."""
        given = self.given()
        if given and not is_aggregate:
            raise UsageError(
                f"{given[0]} gates an aggregate, and {source} has no {REPORT_FILE}: give the "
                "--out folder of hpc-train aggregate, or drop the gate flags to publish a "
                "plain checkpoint")
        upstream = self.max_upstream_drop is not None
        if upstream and self.base_checkpoint is None:
            raise UsageError("--max-upstream-drop needs --base-checkpoint DIR: the checkpoint "
                             "the base release was published from")
        if not upstream and (self.base_checkpoint or self.eval_config):
            raise UsageError("--base-checkpoint and --eval-config go with --max-upstream-drop")
        if self.device_gates and self.device_evals is None:
            raise UsageError("--min-mean-gain, --max-device-drop and --min-devices need "
                             "--device-evals FILE (the devices' scores of base and aggregate)")
        if self.device_evals is not None and not self.device_gates:
            raise UsageError("--device-evals gates nothing by itself: add --min-mean-gain, "
                             "--max-device-drop or --min-devices")
        if self.gain_mean is not None and self.min_mean_gain is None:
            raise UsageError("--gain-mean goes with --min-mean-gain")
        if self.dry_run and not self.any_gate:
            raise UsageError("--dry-run evaluates the gates only: set at least one gate "
                             "(--max-upstream-drop, --min-mean-gain, --max-device-drop, "
                             "--min-devices)")


@dataclass(frozen=True)
class Gate:
    flag: str
    """The option and its value as given, e.g. '--max-device-drop 2'."""
    passed: bool
    detail: str
    """The figures, e.g. 'jetson-03 dropped 3.4 pts (91.0% -> 87.6%)'."""

    @property
    def line(self) -> str:
        return f"{self.flag}: {self.detail}"


@dataclass(frozen=True)
class UpstreamScores:
    base_accuracy: float
    candidate_accuracy: float
    samples: int
    data: DataConfig
    """The held-out split's data config."""

    @property
    def drop_pts(self) -> float:
        return 100.0 * (self.base_accuracy - self.candidate_accuracy)


Evaluate = Callable[[Path, Path, DataConfig], tuple[float, float, int]]
"""(base checkpoint, candidate checkpoint, data) -> (base accuracy, candidate accuracy,
held-out samples): ``hpc_core.evaluation.upstream.base_and_candidate``."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _num(x: float) -> str:
    return f"{x:g}"


def upstream_gate(max_drop: float, s: UpstreamScores) -> Gate:
    change = ("unchanged" if s.drop_pts == 0 else
              f"{'dropped' if s.drop_pts > 0 else 'gained'} {abs(s.drop_pts):.3g} pts")
    return Gate(
        f"--max-upstream-drop {_num(max_drop)}", s.drop_pts <= max_drop + _TOLERANCE_PTS,
        f"held-out accuracy {change} "
        f"({_pct(s.base_accuracy)} -> {_pct(s.candidate_accuracy)}, {s.samples} samples)")


def device_gates(settings: GateSettings, evals: DeviceEvals) -> list[Gate]:
    out = []
    rows = evals.evaluations
    if settings.min_devices is not None:
        names = ", ".join(e.device for e in rows[:_NAMED])
        more = f", and {len(rows) - _NAMED} more" if len(rows) > _NAMED else ""
        listed = f" ({names}{more})" if rows else ""
        out.append(Gate(f"--min-devices {settings.min_devices}",
                        len(rows) >= settings.min_devices,
                        f"{len(rows)} device evaluation(s){listed}"))
    if settings.max_device_drop is not None:
        limit = settings.max_device_drop
        worse = [e for e in rows if -e.gain_pts > limit + _TOLERANCE_PTS]
        if worse:
            detail = "; ".join(f"{e.device} dropped {-e.gain_pts:.3g} pts "
                               f"({_pct(e.base_accuracy)} -> {_pct(e.candidate_accuracy)})"
                               for e in sorted(worse, key=lambda e: e.gain_pts))
        elif rows:
            w = min(rows, key=lambda e: e.gain_pts)
            detail = (f"worst device {w.device}: {w.gain_pts:+.3g} pts "
                      f"({_pct(w.base_accuracy)} -> {_pct(w.candidate_accuracy)})")
        else:
            detail = "no device evaluations"
        out.append(Gate(f"--max-device-drop {_num(limit)}", not worse, detail))
    if settings.min_mean_gain is not None:
        by = settings.gain_mean or "devices"
        flag = f"--min-mean-gain {_num(settings.min_mean_gain)}"
        if not rows:
            out.append(Gate(flag, False, "no device evaluations to average"))
        else:
            gain = evals.mean_gain_pts(by)
            weighting = "plain mean over devices" if by == "devices" else "weighted by samples"
            out.append(Gate(flag, gain >= settings.min_mean_gain - _TOLERANCE_PTS,
                            f"mean gain {gain:+.3g} pts over {len(rows)} device(s) "
                            f"({weighting})"))
    return out


# -- the upstream side ---------------------------------------------------------------------------


def _sha256(r: FileRange) -> str:
    h = hashlib.sha256()
    with open(r.path, "rb") as f:
        f.seek(r.start)
        left = r.nbytes
        while left:
            piece = f.read(min(left, 1 << 20))
            if not piece:  # a truncated file: the digest cannot match
                break
            h.update(piece)
            left -= len(piece)
    return h.hexdigest()


def check_base_weights(checkpoint: Path, base: Manifest) -> None:
    """``checkpoint`` must hold exactly the base release's tensors (dtype, shape and sha256 of
    each), so the reference score is the base's and not some other run's."""
    have = {t.name: t for t in read_safetensors_index(checkpoint / "model.safetensors")}
    problem = None
    if set(have) != {t.name for t in base.tensors}:
        diff = sorted(set(have) ^ {t.name for t in base.tensors})
        problem = f"tensor names differ ({', '.join(diff[:3])}{' ...' if len(diff) > 3 else ''})"
    for t in base.tensors if problem is None else ():
        h = have[t.name]
        if (h.dtype, tuple(h.shape)) != (t.dtype, tuple(t.shape)) or _sha256(h.data) != t.sha256:
            problem = f"tensor {t.name} differs"
            break
    if problem is not None:
        raise UsageError(f"--base-checkpoint {checkpoint} is not {base.ref}: {problem}; give "
                         "the checkpoint the base release was published from")


def upstream_data(settings: GateSettings, base_checkpoint: Path) -> DataConfig:
    """The upstream held-out split: --eval-config's data section, else the base checkpoint's
    own training config."""
    try:
        if settings.eval_config is not None:
            return load_config(settings.eval_config).data
        if (base_checkpoint / REPORT_FILE).is_file():
            # An aggregate's trainer_state.json carries the model spec inside a default config:
            # its data section says nothing of the upstream data.
            raise UsageError(
                f"--base-checkpoint {base_checkpoint} is an aggregate: its config names no "
                "upstream data; add --eval-config with the upstream training config")
        state = read_trainer_state(base_checkpoint)
        return config_from_dict(state["config"], f"{base_checkpoint}/trainer_state.json").data
    except (ConfigError, CheckpointError, OSError, KeyError) as e:
        flag = "--eval-config" if settings.eval_config is not None else "--base-checkpoint"
        raise UsageError(f"{flag}: no data config to evaluate on ({e})") from None


def score_upstream(settings: GateSettings, agg: Aggregate, base: Manifest,
                   evaluate: Evaluate) -> UpstreamScores:
    assert settings.base_checkpoint is not None
    try:
        ckpt = resolve_checkpoint(settings.base_checkpoint)
    except CheckpointError as e:
        raise UsageError(f"--base-checkpoint: {e}") from None
    check_base_weights(ckpt, base)
    data = upstream_data(settings, ckpt)
    base_acc, cand_acc, samples = evaluate(ckpt, agg.folder, data)
    return UpstreamScores(base_acc, cand_acc, samples, data)


# -- the report ----------------------------------------------------------------------------------


@dataclass
class GateOutcome:
    gates: list[Gate]
    path: Path
    """Where the gate report was written."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The figures the published manifest carries (signed) in training.metrics."""

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failures(self) -> list[str]:
        return [g.line for g in self.gates if not g.passed]

    def summary(self) -> str:
        return "\n".join(f"  {'pass' if g.passed else 'FAIL'} {g.line}" for g in self.gates)


def _figures(up: UpstreamScores | None, evals: DeviceEvals | None,
             settings: GateSettings) -> dict[str, Any]:
    out: dict[str, Any] = {"upstream": None, "devices": None}
    if up is not None:
        out["upstream"] = {
            "base_checkpoint": str(settings.base_checkpoint), "samples": up.samples,
            "base_accuracy": up.base_accuracy, "candidate_accuracy": up.candidate_accuracy,
            "drop_pts": up.drop_pts, "data": up.data.model_dump(mode="json"),
        }
    if evals is not None:
        rows = evals.evaluations
        out["devices"] = {
            "file": str(settings.device_evals), "count": len(rows),
            "mean_gain_pts": evals.mean_gain_pts("devices") if rows else None,
            "sample_weighted_mean_gain_pts": evals.mean_gain_pts("samples") if rows else None,
            "mean_by": settings.gain_mean or "devices",
            "evaluations": [dict(e.model_dump(), gain_pts=e.gain_pts) for e in rows],
        }
    return out


def _metrics(up: UpstreamScores | None, evals: DeviceEvals | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if up is not None:
        out |= {"gate/upstream_base_acc": up.base_accuracy,
                "gate/upstream_candidate_acc": up.candidate_accuracy}
    if evals is not None and evals.evaluations:
        out |= {"gate/devices": float(len(evals.evaluations)),
                "gate/device_mean_gain_pts": evals.mean_gain_pts("devices"),
                "gate/device_worst_gain_pts": min(e.gain_pts for e in evals.evaluations)}
    return out


def run_gates(settings: GateSettings, agg: Aggregate, base: Manifest,
              evaluate: Evaluate) -> GateOutcome:
    """Work out every gate, write ``gates.json`` beside ``aggregate.json`` and return the
    outcome. Bad input raises UsageError before anything is scored or written."""
    evals = load_device_evals(settings.device_evals) if settings.device_evals else None
    up = None
    if settings.max_upstream_drop is not None:
        up = score_upstream(settings, agg, base, evaluate)
    gates = [upstream_gate(settings.max_upstream_drop, up)] if up is not None else []
    gates += device_gates(settings, evals) if evals is not None else []
    outcome = GateOutcome(gates, agg.folder / GATES_FILE, _metrics(up, evals))
    write_json_atomic(outcome.path, {
        "format": FORMAT,
        "created_at": utc_now().isoformat().replace("+00:00", "Z"),
        "aggregate": str(agg.folder), "model": agg.report.model,
        "base": agg.report.base.model_dump(), "combined": list(agg.report.combined),
        "aggregate_report_sha256": agg.report_sha256,
        "dry_run": settings.dry_run, "passed": outcome.passed,
        "gates": [{"flag": g.flag, "passed": g.passed, "detail": g.detail} for g in gates],
        "failures": outcome.failures,
        **_figures(up, evals, settings),
    })
    return outcome
