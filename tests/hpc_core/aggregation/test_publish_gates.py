"""`hpc-train publish AGG_DIR`: the aggregate's lineage in the signed manifest, and the gates
(upstream held-out drop, device evaluations) that must pass before anything is published.

A real folder registry: an mlp trained on sklearn's digits published as release 1 through the
publish command, device fine-tunes of it, the real `hpc-train aggregate`, then publish with
gates. The upstream figures are checked against a numpy forward pass of the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

from hpc_core.checkpoint import save_checkpoint
from hpc_core.config import config_from_dict
from hpc_core.data import build_datasets, held_out
from hpc_core.models import build_model
from hpc_core.publish_cli import register_cli
from registry.manifest import BaseRelease, Manifest
from registry.model_config import ModelConfig
from registry.pull import fetch_verified_manifest
from registry.refs import Ref
from registry.signing import load_trusted_keys
from registry.transfer import TransferConfig
from tests.hpc_core.aggregation.conftest import Result
from tests.support.fleet_registry import FleetRegistry

MODEL = {"name": "mlp", "kwargs": {"hidden": [32]}, "num_classes": 10, "in_channels": 1,
         "image_size": 8}
DEVICES = 3


@dataclass(frozen=True)
class Upstream:
    checkpoint: Path
    tensors: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Upstream:
    """The upstream run: an mlp fitted full-batch to the digits training split (~1 s)."""
    cfg = config_from_dict({"model": MODEL, "data": {"source": "digits"}})
    train, _, _ = build_datasets(cfg.data)
    x, y = (torch.from_numpy(a) for a in held_out(train, None))
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10, in_channels=1, image_size=8, hidden=[32])
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(120):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    dest = save_checkpoint(tmp_path_factory.mktemp("upstream") / "final",
                           model_state=model.state_dict(),
                           trainer_state={"step": 120, "epoch": None, "config": cfg.to_dict(),
                                          "metrics": {}})
    return Upstream(dest, load_file(str(dest / "model.safetensors")))


def numpy_accuracy(tensors: dict[str, np.ndarray]) -> float:
    """Flatten -> Linear -> ReLU -> Linear on the default digits validation split, no torch."""
    _, val, _ = build_datasets(config_from_dict({"data": {"source": "digits"}}).data)
    x, y = held_out(val, None)
    h = np.maximum(x.reshape(len(x), -1) @ tensors["1.weight"].T + tensors["1.bias"], 0)
    logits = h @ tensors["3.weight"].T + tensors["3.bias"]
    return float((logits.argmax(1) == y).mean())


@pytest.fixture
def fleet(tmp_path: Path) -> FleetRegistry:
    """The aggregation tests' registry, for the digits mlp (overrides conftest's)."""
    return FleetRegistry.create(tmp_path / "fleet", spec=ModelConfig.model_validate(MODEL))


def publish(*argv: str) -> Result:
    parser = argparse.ArgumentParser(prog="hpc-train")
    register_cli(parser.add_subparsers(dest="command", required=True))
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            args = parser.parse_args(["publish", *argv])
            code = args.func(args)
        except SystemExit as e:
            code = int(e.code or 0)
    return Result(code, Path(argv[0]), stdout.getvalue(), stderr.getvalue())


@dataclass
class Round:
    fleet: FleetRegistry
    base: Manifest
    agg: Result
    upstream: Upstream

    @property
    def key(self) -> str:
        return str(self.fleet.work / "keys" / "upstream.key.pem")

    def publish(self, *options: str, version: str = "2", source: Path | None = None) -> Result:
        return publish(str(source or self.agg.out), "--registry", str(self.fleet.root),
                       "--name", self.fleet.name, "--version", version, "--sign-key", self.key,
                       *options)

    def versions(self) -> list[str]:
        return self.fleet.store.list_versions(self.fleet.name)

    def gates(self) -> dict[str, Any]:
        return json.loads((self.agg.out / "gates.json").read_text())

    def evals(self, tmp: Path, rows: list[tuple[str, int, float, float]]) -> str:
        path = tmp / f"evals-{len(list(tmp.glob('evals-*')))}.json"
        path.write_text(json.dumps({"evaluations": [
            {"device": d, "samples": n, "base_accuracy": b, "candidate_accuracy": c}
            for d, n, b, c in rows]}))
        return str(path)


@pytest.fixture
def make_round(fleet: FleetRegistry, upstream: Upstream,
               aggregate: Callable[..., Result]) -> Callable[[float], Round]:
    """make_round(noise): release 1 published by `hpc-train publish` from the upstream run,
    three device fine-tunes = base + N(0, noise) per weight, aggregated with fedavg."""

    def make(noise: float) -> Round:
        res = publish(str(upstream.checkpoint), "--registry", str(fleet.root), "--name",
                      fleet.name, "--version", "1", "--sign-key",
                      str(fleet.work / "keys" / "upstream.key.pem"))
        assert res.code == 0, res.stderr
        base = Manifest.from_bytes((fleet.root / fleet.name / "1" / "manifest.json").read_bytes())
        rng = np.random.default_rng(0)
        deltas = [{k: rng.normal(0, noise, v.shape).astype(np.float32)
                   for k, v in upstream.tensors.items()} for _ in range(DEVICES)]
        fleet.fine_tunes(base, upstream.tensors, deltas, samples=[100.0] * DEVICES)
        agg = aggregate("--strategy", "fedavg")
        assert agg.code == 0, agg.stderr
        return Round(fleet, base, agg, upstream)

    return make


def test_lineage_is_signed_and_a_device_verifies_it(make_round: Callable[[float], Round],
                                                    tmp_path: Path) -> None:
    r = make_round(1e-3)
    evals = r.evals(tmp_path, [("jetson-01", 200, 0.90, 0.92), ("jetson-02", 150, 0.88, 0.89)])
    res = r.publish("--base-checkpoint", str(r.upstream.checkpoint), "--max-upstream-drop", "1",
                    "--device-evals", evals, "--min-devices", "2", "--max-device-drop", "0",
                    "--min-mean-gain", "1.5")
    assert res.code == 0, res.stderr
    assert "published digits@2" in res.stdout and "pass --min-mean-gain 1.5" in res.stdout

    # What a device does before installing: signature, key scope, schema, served name.
    verified = fetch_verified_manifest(r.fleet.store, Ref(r.fleet.name, "2", str(r.fleet.root)),
                                       load_trusted_keys(r.fleet.trusted), TransferConfig())
    m = verified.manifest
    lineage = m.training.aggregate
    assert lineage is not None and m.parent == "1" and m.base is None  # an upstream release
    assert lineage.base == BaseRelease(version="1", sequence=r.base.sequence)
    assert list(lineage.combined) == r.agg.report["combined"] and len(lineage.combined) == DEVICES
    assert lineage.strategy == "fedavg"
    assert lineage.report_sha256 == hashlib.sha256(
        (r.agg.out / "aggregate.json").read_bytes()).hexdigest()
    assert b'"aggregate": {' in verified.manifest_bytes  # in the signed bytes themselves
    gates = r.gates()
    assert gates["passed"] and gates["failures"] == []
    assert m.training.metrics["gate/upstream_candidate_acc"] == gates["upstream"][
        "candidate_accuracy"]
    assert m.training.metrics["gate/device_mean_gain_pts"] == pytest.approx(1.5)
    # A release that is no aggregate keeps the bytes it had before the field existed.
    assert b"aggregate" not in (r.fleet.root / r.fleet.name / "1" / "manifest.json").read_bytes()


def test_upstream_drop_refuses_and_publishes_nothing(make_round: Callable[[float], Round]
                                                     ) -> None:
    r = make_round(0.3)  # noise as large as the weights: the aggregate forgets the digits
    before = r.versions()
    res = r.publish("--base-checkpoint", str(r.upstream.checkpoint), "--max-upstream-drop", "1")
    assert res.code == 4, res.stderr
    assert r.versions() == before
    up = r.gates()["upstream"]
    # The figures are those of a forward pass written out in numpy, on the same split.
    assert up["base_accuracy"] == pytest.approx(numpy_accuracy(r.upstream.tensors), abs=1e-9)
    assert up["candidate_accuracy"] == pytest.approx(numpy_accuracy(r.agg.tensors), abs=1e-9)
    assert up["base_accuracy"] > 0.9 and up["drop_pts"] > 1 and up["samples"] == 359
    want = (f"--max-upstream-drop 1: held-out accuracy dropped {up['drop_pts']:.3g} pts "
            f"({100 * up['base_accuracy']:.1f}% -> {100 * up['candidate_accuracy']:.1f}%, "
            "359 samples)")
    assert want in res.stderr.splitlines()[1] and "nothing published" in res.stderr
    assert not r.gates()["passed"] and r.gates()["failures"] == [want]


def test_upstream_gate_passes_a_small_change(make_round: Callable[[float], Round],
                                             tmp_path: Path) -> None:
    r = make_round(1e-3)
    res = r.publish("--base-checkpoint", str(r.upstream.checkpoint), "--max-upstream-drop", "1",
                    "--dry-run")
    assert res.code == 0, res.stderr
    assert "pass --max-upstream-drop 1: held-out accuracy" in res.stdout
    assert "would publish digits@2" in res.stdout and "2" not in r.versions()
    up = r.gates()["upstream"]
    assert abs(up["drop_pts"]) <= 1 and r.gates()["dry_run"] and up["samples"] == 359
    # --eval-config names another split: 10% held out instead of the run's 20%.
    config = tmp_path / "upstream.yaml"
    config.write_text("data: {source: digits, val_fraction: 0.1}\n")
    res = r.publish("--base-checkpoint", str(r.upstream.checkpoint), "--max-upstream-drop", "1",
                    "--eval-config", str(config), "--dry-run")
    assert res.code == 0 and r.gates()["upstream"]["samples"] == 180, res.stderr


def test_round_two_scores_against_the_upstream_config(make_round: Callable[[float], Round],
                                                      aggregate: Callable[..., Result],
                                                      tmp_path: Path) -> None:
    """Release 2 is round 1's aggregate: its folder is round 2's base checkpoint, and its
    config names no data, so the upstream config must."""
    r = make_round(1e-3)
    assert r.publish().code == 0
    release2 = Manifest.from_bytes((r.fleet.root / "digits" / "2" / "manifest.json").read_bytes())
    rng = np.random.default_rng(1)
    r.fleet.fine_tunes(release2, r.agg.tensors, [
        {k: rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in r.agg.tensors.items()}
        for _ in range(DEVICES)], prefix="second")
    agg2 = aggregate(base="2")
    assert agg2.code == 0, agg2.stderr
    gate = ["--base-checkpoint", str(r.agg.out), "--max-upstream-drop", "1"]
    res = r.publish(*gate, version="3", source=agg2.out)
    assert res.code == 2 and "is an aggregate" in res.stderr and "--eval-config" in res.stderr
    config = tmp_path / "upstream.yaml"
    config.write_text("data: {source: digits}\n")
    res = r.publish(*gate, "--eval-config", str(config), version="3", source=agg2.out)
    assert res.code == 0, res.stderr
    m = Manifest.from_bytes((r.fleet.root / "digits" / "3" / "manifest.json").read_bytes())
    assert m.parent == "2" and m.training.aggregate is not None
    assert m.training.aggregate.base == BaseRelease(version="2", sequence=release2.sequence)


DEVICE_ROWS = [("jetson-01", 100, 0.90, 0.92), ("jetson-02", 100, 0.85, 0.86),
               ("jetson-03", 800, 0.91, 0.876)]
# Gains +2, +1, -3.4 pts: plain mean -0.133, weighted by samples (200 + 100 - 2720) / 1000.


@pytest.mark.parametrize(("options", "passed", "line"), [
    (["--min-devices", "3"], True, "--min-devices 3: 3 device evaluation(s) "
     "(jetson-01, jetson-02, jetson-03)"),
    (["--min-devices", "4"], False, "--min-devices 4: 3 device evaluation(s) "
     "(jetson-01, jetson-02, jetson-03)"),
    (["--max-device-drop", "3.4"], True, "--max-device-drop 3.4: worst device jetson-03: "
     "-3.4 pts (91.0% -> 87.6%)"),
    (["--max-device-drop", "2"], False, "--max-device-drop 2: jetson-03 dropped 3.4 pts "
     "(91.0% -> 87.6%)"),
    (["--min-mean-gain", "-0.2"], True, "--min-mean-gain -0.2: mean gain -0.133 pts over 3 "
     "device(s) (plain mean over devices)"),
    (["--min-mean-gain", "0"], False, "--min-mean-gain 0: mean gain -0.133 pts over 3 "
     "device(s) (plain mean over devices)"),
    (["--min-mean-gain", "-0.2", "--gain-mean", "samples"], False, "--min-mean-gain -0.2: mean "
     "gain -2.42 pts over 3 device(s) (weighted by samples)"),
])
def test_device_gates(make_round: Callable[[float], Round], tmp_path: Path, options: list[str],
                      passed: bool, line: str) -> None:
    r = make_round(1e-3)
    evals = r.evals(tmp_path, DEVICE_ROWS)
    res = r.publish("--device-evals", evals, *options)
    assert res.code == (0 if passed else 4), res.stderr
    assert r.gates()["gates"][0]["passed"] is passed
    if passed:
        assert f"pass {line}" in res.stdout and "published digits@2" in res.stdout
        assert "2" in r.versions()
    else:
        assert f"FAIL {line}" in res.stdout
        assert res.stderr.splitlines()[1:] == [f"  {line}"]
        assert "2" not in r.versions()
        assert r.gates()["failures"] == [line]
    devices = r.gates()["devices"]
    assert devices["mean_gain_pts"] == pytest.approx(-0.4 / 3)
    assert devices["sample_weighted_mean_gain_pts"] == pytest.approx(-2.42)


def test_every_failed_gate_is_one_line_and_a_dry_run_publishes_nothing(
        make_round: Callable[[float], Round], tmp_path: Path) -> None:
    r = make_round(0.3)
    before = r.versions()
    res = r.publish("--base-checkpoint", str(r.upstream.checkpoint), "--max-upstream-drop", "5",
                    "--device-evals", r.evals(tmp_path, DEVICE_ROWS), "--min-devices", "5",
                    "--max-device-drop", "1", "--min-mean-gain", "1", "--dry-run")
    assert res.code == 4
    flags = [line.split(":")[0].strip() for line in res.stderr.splitlines()[1:]]
    assert flags == ["--max-upstream-drop 5", "--min-devices 5", "--max-device-drop 1",
                     "--min-mean-gain 1"]
    assert r.versions() == before


@pytest.mark.parametrize(("doc", "needle"), [
    ({"evaluations": [{"device": "j1", "samples": 10, "base_accuracy": 0.9,
                       "candidate_accuracy": 0.9, "note": "x"}]},
     "evaluations.0.note: unknown key (known keys: device, samples, base_accuracy"),
    ({"evaluations": [{"device": "j1", "samples": 10, "base_accuracy": 0.9,
                       "candidate_accuracy": 91.0}]}, "evaluations.0.candidate_accuracy"),
    ({"evaluations": [{"device": "j1", "samples": 0, "base_accuracy": 0.9,
                       "candidate_accuracy": 0.9}]}, "evaluations.0.samples"),
    ({"evaluations": [{"device": "j1", "samples": "10", "base_accuracy": 0.9,
                       "candidate_accuracy": 0.9}]}, "evaluations.0.samples"),
    ({"evaluations": [{"device": "j1", "samples": 10, "base_accuracy": 0.9,
                       "candidate_accuracy": 0.9}] * 2}, "j1 is listed twice"),
    ({"evaluations": [{"device": "../j1", "samples": 10, "base_accuracy": 0.9,
                       "candidate_accuracy": 0.9}]}, "evaluations.0.device"),
    ({"devices": []}, "evaluations: Field required"),
    ("not json", "not valid JSON"),
    (None, "No such file"),
])
def test_a_bad_evaluations_file_exits_2(make_round: Callable[[float], Round], tmp_path: Path,
                                        doc: Any, needle: str) -> None:
    r = make_round(1e-3)
    path = tmp_path / "evals.json"
    if doc is not None:
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    res = r.publish("--device-evals", str(path), "--max-device-drop", "2")
    assert res.code == 2 and needle in res.stderr and "--device-evals" in res.stderr, res.stderr
    assert "2" not in r.versions() and not (r.agg.out / "gates.json").exists()


def test_gate_flags_need_an_aggregate_and_what_each_gate_reads(
        make_round: Callable[[float], Round], tmp_path: Path) -> None:
    r = make_round(1e-3)
    evals = r.evals(tmp_path, DEVICE_ROWS)
    plain, before = r.upstream.checkpoint, r.versions()
    for options, needle in [
        (["--device-evals", evals, "--max-device-drop", "2"], "has no aggregate.json"),
        (["--dry-run"], "--dry-run gates an aggregate"),
    ]:
        res = r.publish(*options, source=plain)
        assert res.code == 2 and needle in res.stderr, res.stderr
    for options, needle in [
        (["--max-upstream-drop", "1"], "needs --base-checkpoint DIR"),
        (["--max-device-drop", "2"], "need --device-evals FILE"),
        (["--device-evals", evals], "gates nothing by itself"),
        (["--dry-run"], "set at least one gate"),
        (["--max-device-drop", "-1"], "want a finite number of percentage points >= 0"),
        (["--base-checkpoint", str(r.agg.out), "--max-upstream-drop", "1"],
         "--base-checkpoint"),
    ]:
        res = r.publish(*options)
        assert res.code == 2 and needle in res.stderr, (options, res.stderr)
    # A checkpoint that is not the base release is no reference.
    other = save_checkpoint(tmp_path / "other", model_state={
        k: torch.from_numpy(v + 1) for k, v in r.upstream.tensors.items()},
        trainer_state=json.loads((plain / "trainer_state.json").read_text()))
    res = r.publish("--base-checkpoint", str(other), "--max-upstream-drop", "1")
    assert res.code == 2 and f"is not {r.fleet.name}@1: tensor" in res.stderr, res.stderr
    assert r.versions() == before


def test_an_aggregate_without_gates_still_records_its_lineage(
        make_round: Callable[[float], Round]) -> None:
    r = make_round(1e-3)
    res = r.publish("--name", "other")  # the last --name wins
    assert res.code == 2 and "publish it as --name digits" in res.stderr, res.stderr
    res = r.publish("--parent", r.agg.report["combined"][0], version="2b")
    assert res.code == 0, res.stderr
    m = Manifest.from_bytes((r.fleet.root / r.fleet.name / "2b" / "manifest.json").read_bytes())
    assert m.parent == r.agg.report["combined"][0]  # --parent as given; lineage as made
    assert m.training.aggregate is not None and m.training.aggregate.base.version == "1"
    assert not any(k.startswith("gate/") for k in m.training.metrics)
    assert not (r.agg.out / "gates.json").exists()


def test_help_has_a_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    res = publish("--help")
    assert res.code == 0
    for needle in ("worked example", "--max-upstream-drop", "--base-checkpoint", "gates.json",
                   "4 refused by the gates", "--dry-run", "training.aggregate"):
        assert needle in res.stdout
