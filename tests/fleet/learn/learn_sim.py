"""Simulated devices that take part in fleet learning: a fine-tune uploads a version (a real,
device-signed one into a folder registry, or a name only), an ``evaluate`` answers with the
agent's ``evaluation`` (the candidate beside its baseline on the same samples).

``LearnSimDevice`` is ``fleet.sim.device.SimDevice`` with those two jobs; ``start`` builds a
``SimFleet`` of them. How each device scores is set per device in ``Scores``.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from contract import ErrorInfo, JobOutcome, ModelInfo
from fleet.learn import report as learn_report
from fleet.learn.store import LearnStore
from fleet.mqtt import BrokerConfig
from fleet.rollout.store import FleetStore
from fleet.sim.config import SimConfig
from fleet.sim.device import SimDevice, _Job
from fleet.sim.fleet import SimFleet
from registry.manifest import MAX_MANIFEST_BYTES, Manifest
from registry.names import chunk_key, manifest_key
from tests.support.fleet_registry import STAMP, FleetRegistry

_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
       "I32": np.int32}


def read_tensors(reg: FleetRegistry, version: str) -> tuple[Manifest, dict[str, np.ndarray]]:
    """A version of a folder registry, as the manifest and its tensors (no verification)."""
    store = reg.store
    raw = store.get(manifest_key(reg.name, version), MAX_MANIFEST_BYTES)
    assert raw is not None, f"{reg.name}@{version} is not in {reg.root}"
    m = Manifest.from_bytes(raw, source=version)
    blob = b"".join(store.path(chunk_key(c.sha256)).read_bytes() for c in m.chunks)
    return m, {t.name: np.frombuffer(blob[t.offset:t.offset + t.nbytes],
                                     dtype=_NP[t.dtype]).reshape(t.shape).copy()
               for t in m.tensors}


@dataclass
class Scores:
    """What the simulated devices upload and how they score a candidate."""

    registry: FleetRegistry | None = None
    """Uploads go here, signed with each device's key (None: a version name only)."""
    base_accuracy: float = 0.80
    gain: float = 0.02
    """candidate - base accuracy, on every device not in ``gains``."""
    gains: dict[str, float] = field(default_factory=dict)
    by_candidate: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per candidate version, per device gains that replace the above."""
    samples: int = 120
    personal_gain: float = 0.05
    """How much more the candidate scores personalized (``evaluate.personal``) than global."""
    spread: float = 0.01
    """Standard deviation of an honest simulated fine-tune's change to each weight."""
    poisoned: dict[str, float] = field(default_factory=dict)
    """Device -> k: its uploads are ``base + k x`` an honest fine-tune's delta (signed with
    its own, valid key)."""
    uploads: list[tuple[str, str]] = field(default_factory=list)
    """(device, version) of every upload, in order."""
    _n: Any = field(default_factory=lambda: itertools.count(1))

    def upload(self, device: str, base: str) -> str:
        if self.registry is None:
            version = f"{base}+{device}.{STAMP}.{next(self._n)}"
        else:
            release, tensors = read_tensors(self.registry, base)
            rng = np.random.default_rng(len(self.uploads))
            k = self.poisoned.get(device, 1.0)
            moved = {name: (v + k * rng.normal(0, self.spread, v.shape)).astype(v.dtype)
                     for name, v in tensors.items()}
            m = self.registry.update(self.registry.device(device), release, moved,
                                     samples=float(self.samples))
            version = m.version
        self.uploads.append((device, version))
        return version


class LearnSimDevice(SimDevice):
    def __init__(self, fleet: SimFleet, device_id: str, behavior: Any, scores: Scores) -> None:
        super().__init__(fleet, device_id, behavior)
        self.scores = scores

    def _train_or_deploy(self, job: _Job) -> None:
        if job.type not in ("finetune", "evaluate") or self.behavior.fail:
            super()._train_or_deploy(job)
            return
        if job.type == "evaluate":
            self._evaluate(job)
            return
        base = str(job.args["version"])
        version = self.scores.upload(self.id, base)
        prev = self.model
        self.model = ModelInfo(name=prev.name, version=version, sequence=(prev.sequence or 0) + 1,
                               slot="b" if prev.slot == "a" else "a")
        self.standby = prev
        acc = self.scores.base_accuracy
        out = JobOutcome(outcome="committed", metrics_before={"eval/acc": acc},
                         metrics_after={"eval/acc": acc + 0.01}, model=self.model,
                         previous_model=prev,
                         uploaded={"name": prev.name, "version": version, "parent": base})
        self.send_event("model_committed", {"version": version, "job": job.id})
        self.publish_status()
        self._finish(job, "SUCCEEDED", result=out.model_dump(mode="json", exclude_none=True))

    def _evaluate(self, job: _Job) -> None:
        args = job.args
        base = (args.get("evaluate") or {}).get("baseline")
        if base is None:
            self._finish(job, "FAILED", error=ErrorInfo(code="JOB_FAILED",
                                                        message="simulated: no baseline"))
            return
        s = self.scores
        gain = s.by_candidate.get(args["version"], {}).get(self.id, s.gains.get(self.id, s.gain))
        cand = round(s.base_accuracy + gain, 6)
        evaluation = {"version": args["version"], "accuracy": cand, "samples": s.samples,
                      "candidate": {"accuracy": cand, "runtime": "sim", "finite": True},
                      "baseline": {"version": base, "accuracy": s.base_accuracy,
                                   "runtime": "sim", "finite": True},
                      "gain_pts": round(100 * (cand - s.base_accuracy), 3)}
        personal = (args.get("evaluate") or {}).get("personal")
        if personal:
            evaluation["personalized"] = {"accuracy": round(cand + s.personal_gain, 6),
                                          "parts": personal, "runtime": "sim", "finite": True}
        out = JobOutcome(outcome="unchanged", metrics_before={"eval/acc": s.base_accuracy},
                         metrics_after={"eval/acc": cand}, model=self.model,
                         previous_model=self.model)
        result = out.model_dump(mode="json", exclude_none=True) | {"evaluation": evaluation}
        self._finish(job, "SUCCEEDED", result=result)


def start(broker: BrokerConfig, scores: Scores, **cfg: Any) -> SimFleet:
    """A started SimFleet of LearnSimDevices (``cfg``: SimConfig fields)."""
    fleet = SimFleet(SimConfig.model_validate(cfg), broker)
    fleet.devices = {d: LearnSimDevice(fleet, d, dev.behavior, scores)
                     for d, dev in fleet.devices.items()}
    return fleet.start()


def round_state(db: Path, learn: str) -> dict[str, Any] | None:
    """The learn's latest round as its controller last stored it (None before it has one)."""
    try:
        with sqlite3.connect(db, timeout=5) as c:
            row = c.execute("SELECT state FROM learn_rounds WHERE learn_id = ? "
                            "ORDER BY round DESC LIMIT 1", (learn,)).fetchone()
    except sqlite3.OperationalError:
        return None
    return None if row is None else json.loads(row[0])


def open_jobs(db: Path, rollout_prefix: str, *, accepted: bool = False) -> int:
    """Jobs of the rollouts named ``rollout_prefix...`` that are out on devices; with
    ``accepted``, only those a device has answered ACCEPTED (or started): a job recorded SENT
    may not have reached the broker yet when its controller dies."""
    statuses = ("ACCEPTED", "IN_PROGRESS") if accepted else ("SENT", "ACCEPTED", "IN_PROGRESS")
    try:
        with sqlite3.connect(db, timeout=5) as c:
            return int(c.execute(
                "SELECT COUNT(*) FROM executions WHERE rollout_id LIKE ? AND status IN "
                f"({', '.join('?' * len(statuses))})",
                (rollout_prefix + "%", *statuses)).fetchone()[0])
    except sqlite3.OperationalError:
        return 0


def mlp_registry(where: Path, devices: int) -> FleetRegistry:
    """A real folder registry holding release 1 of a small mlp, signed by upstream, and the
    keys of devices ``sim-0000...`` made up front (trusted, scoped to their own versions)."""
    reg = FleetRegistry.create(where, name="digits")
    rng = np.random.default_rng(0)
    shapes = {"1.weight": (8, 4), "1.bias": (8,), "3.weight": (2, 8), "3.bias": (2,)}
    reg.release("1", {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in shapes.items()})
    for i in range(devices):
        reg.device(f"sim-{i:04d}")
    return reg


def learn_status(tmp_path: Path, name: str, db: str | None = None) -> dict[str, Any]:
    """What ``fleetctl learn status NAME --json`` prints, read from the db in this process."""
    store = FleetStore(db or tmp_path / "fleet.db")
    try:
        return learn_report.load(store, LearnStore(store), name)
    finally:
        store.close()
