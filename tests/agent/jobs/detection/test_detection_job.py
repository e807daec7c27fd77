"""The device job for a detector, through the real worker: pull the upstream SSDlite from an
HTTP registry, plan its micro-batch under the Orin Nano 8 GB profile's budget (probes of list
batches), fine-tune it paced by that board's simulated governor, stage it, check its health by
COCO mAP against the active model, then commit (and upload) or roll back; a job that gives a
detector classification data is refused before it trains (its export:
``test_detection_export_job``). The rollback runs through the daemon (agentctl over its
control socket), the others through the worker the daemon starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.jobs.spec import DeviceJob
from agent.jobs.store import JobState, JobStore
from tests.agent.daemon.conftest import AgentProc
from tests.agent.jobs.detection.conftest import DetectorDevice
from tests.agent.jobs.test_device_job import tree_digest, worker
from tests.support.mosquitto import Broker, free_port

pytestmark = pytest.mark.slow

BUDGET_MB = 4800.0
"""jetson-orin-nano-8gb's training budget (device_profiles), which the jobs run under."""


def run_job(dev: DetectorDevice, job_id: str, **over: Any) -> tuple[Any, dict[str, Any]]:
    """Submit the detector job (with ``over``), run the worker to its end: the record and
    the outputs of its steps."""
    spec = DeviceJob.model_validate(dev.spec(**over))
    store = JobStore(dev.state)
    store.submit(job_id, "finetune", spec.model_dump(mode="json"))
    store.close()
    r = worker(dev.state, job_id, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    store = JobStore(dev.state)
    rec, steps = store.get(job_id), store.steps(job_id)
    store.close()
    assert rec is not None
    return rec, {s.name: {"status": s.status, **(s.outputs or {})} for s in steps}


def rescore(slot: Path, setup: dict[str, Any]) -> Any:
    """COCO's metrics, straight from pycocotools' ``evaluate_detections``, of ``slot``'s model
    on the job's held-out split (its set-up's data config), batched as the health check did."""
    from agent.finetune.model import load_upstream
    from exporters.runtime import TorchRunner, predict
    from hpc_core.config import DataConfig
    from hpc_core.tasks.detection.metrics import evaluate_detections
    from hpc_core.tasks.detection.sources import LABEL_OFFSET, build_detection_datasets

    _, val, _ = build_detection_datasets(DataConfig.model_validate(setup["config"]["data"]))
    items = [val[i] for i in range(len(val))]
    x = np.stack([im.numpy() for im, _ in items]).astype(np.float32)
    model, _ = load_upstream(slot)
    micro = setup["config"]["training"]["micro_batch_size"]
    preds = predict(TorchRunner(model.eval()), x, batch=micro)
    assert len(preds) == len(items) and all(len(p["boxes"]) for p in preds)  # real detections
    shift = [{**p, "labels": p["labels"] - LABEL_OFFSET} for p in preds]
    truth = [{k: v.numpy() for k, v in t.items()} for _, t in items]
    truth = [{**t, "labels": t["labels"] - LABEL_OFFSET} for t in truth]
    return evaluate_detections(shift, truth, val.dataset.class_names)


def test_a_detector_job_plans_fine_tunes_and_commits_by_map(
        detector_device: DetectorDevice) -> None:
    dev = detector_device
    # Planned (no micro-batch given): probes at 2, 4 and 8 samples of list batches. A tiny
    # detector's mAP is a few points: a drop of up to 5 is allowed here, the rollback test
    # holds the gate to a figure it cannot meet.
    rec, out = run_job(dev, "d1", finetune={"micro_batch": None, "effective_batch": 8},
                       health={"max_accuracy_drop_pts": 5.0}, steps={"upload": True})
    assert rec.state is JobState.SUCCEEDED, (rec.error, out)
    res = rec.result
    assert res["outcome"] == "committed" and res["gate_metric"] == "eval/map"
    h = out["health"]
    assert h["gate_metric"] == "map" and h["passed"] and h["failures"] == []
    a, s = h["active"], h["staged"]
    # Scored by mAP, in torch (a detector has no exported artefact), no top-1 anywhere.
    assert (a["runtime"], s["runtime"], a["accuracy"], s["accuracy"]) == (
        "torch", "torch", None, None)
    assert res["metrics_before"] == {"eval/map": a["metric"]}
    assert res["metrics_after"] == {"eval/map": s["metric"]}
    assert 100 * (a["metric"] - s["metric"]) <= 5.0
    # The health step's figures are pycocotools' on the same predictions, for both models:
    # the staged one (now active) and the upstream the job started from.
    setup = json.loads((dev.state / "jobs/d1/setup.json").read_text())
    staged = dev.state / "models/det/current"
    for figures, slot in ((s, staged), (a, Path(out["pull"]["path"]))):
        m = rescore(slot, setup)
        assert figures["metric"] == pytest.approx(m.map, abs=1e-12)
        assert figures["metrics"]["map50"] == pytest.approx(m.map_50, abs=1e-12)
        assert figures["metrics"]["ar100"] == pytest.approx(m.ar_100, abs=1e-12)
    # The memory plan fixed the micro-batch; every step's whole process tree stayed within
    # 1.05 x the profile's budget.
    mem, plan = res["memory"], out["finetune"]["memory"]["plan"]
    assert mem["planned"] and mem["budget_mb"] == BUDGET_MB
    assert sorted(plan["probes"]) == ["2", "4", "8"] and mem["micro_batch"] == plan[
        "micro_batch_size"] == 8
    assert 0 < plan["predicted_tree_peak_mb"] <= BUDGET_MB
    assert {"pull", "finetune", "stage", "health", "commit", "upload"} <= set(
        mem["steps_peak_mb"])
    assert all(0 < v <= 1.05 * BUDGET_MB for v in mem["steps_peak_mb"].values()), mem
    # The upload runs in the job's torch-free worker: the detector's layout (torchvision's)
    # comes from the version the stage step recorded, not from building the module again
    # (torch and torchvision alone took the worker past 300 MB).
    assert mem["steps_peak_mb"]["upload"] < 150, mem
    # So does the stage step: it checks the fine-tune's tensors against the layout the upstream
    # version recorded for the same spec (the staged version records it in turn).
    assert mem["steps_peak_mb"]["stage"] < 150, mem
    # The board's governor paced it (the simulated Orin Nano heats as it trains).
    assert res["governor"]["max_temp_c"] is not None and res["governor"]["target_c"] == 85.0
    assert out["finetune"]["gate_metric"] == "eval/map"
    # The committed version is a detector, signed by the device and uploaded with parent v1.
    from agent.storage.slots import ModelSlots, read_installed

    active = ModelSlots(dev.state, "det").active()
    assert active is not None and active.version == res["model"]["version"]
    assert active.manifest.model.task == "detection"
    upstream = read_installed(Path(out["pull"]["path"]), "upstream")
    assert upstream is not None and upstream.manifest.layout is not None
    assert active.manifest.layout == upstream.manifest.layout
    assert not (active.path / "artefacts").exists() or not any(
        (active.path / "artefacts").iterdir())
    assert res["uploaded"] == {"name": "det", "version": active.version, "parent": "v1"}
    metrics = active.manifest.training.metrics
    assert "device/acc" not in metrics  # no top-1 for a detector, its mAP under its name
    uploaded = out["upload"]
    assert uploaded["parent"] == "v1" and uploaded["signer"] == "device"


def test_a_detector_below_its_min_map_is_rolled_back_leaving_the_models_untouched(
        detector_device: DetectorDevice, subprocess_env: dict[str, str],
        tmp_path: Path) -> None:
    """Through the daemon, as a device owner runs it: ``agentctl finetune --follow`` over the
    control socket (the broker unreachable), the daemon's own registry and data root."""
    dev = detector_device
    dev.install()
    before = tree_digest(dev.state / "models")
    nowhere = Broker("127.0.0.1", free_port(), tmp_path / "none.conf", tmp_path)  # never started
    daemon = AgentProc(tmp_path / "agent", nowhere, "cam-a", subprocess_env,
                       state_dir=str(dev.state), data_root=str(dev.data.parent),
                       registry={"url": dev.registry.url})
    daemon.start()
    try:  # the job's worker and its children share the 2 cores with the rest of the suite
        ft = dev.base_spec()["finetune"]
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli", "finetune", "--model", dev.model,
             "--data", dev.data.name, "--profile", ft["profile"], "--sensors", ft["sensors"],
             "--trainable", "all", "--steps", str(ft["steps"]), "--effective-batch",
             str(ft["effective_batch"]), "--micro-batch", str(ft["micro_batch"]),
             "--val-fraction", str(ft["val_fraction"]), "--no-export",
             "--health-min-accuracy", "0.99", "--job-id", "d2", "--follow",
             "--state-dir", str(dev.state)],
            env=subprocess_env, capture_output=True, text=True, timeout=900, check=False)
    finally:
        stopped = daemon.stop(timeout_s=180)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr, (
        done.stdout[-2000:] + done.stderr[-2000:] + daemon.log.read_text()[-3000:])
    assert stopped == 0, daemon.log.read_text()[-3000:]
    store = JobStore(dev.state)
    rec, steps = store.get("d2"), store.steps("d2")
    store.close()
    assert rec is not None
    out = {s.name: {"status": s.status, **(s.outputs or {})} for s in steps}
    assert rec.state is JobState.FAILED and rec.result["outcome"] == "rolled_back", rec.error
    assert "mAP@0.5:0.95" in rec.result["reason"], rec.result["reason"]
    assert "below health.min_accuracy=0.99" in rec.error["message"]
    assert "rollback" in out and "commit" not in out
    assert out["health"]["passed"] is False and out["health"]["staged"]["metric"] < 0.99
    assert tree_digest(dev.state / "models") == before


def test_a_detector_job_that_cannot_run_is_refused_before_it_trains(
        detector_device: DetectorDevice, tmp_path: Path) -> None:
    """Given classification data, the job fails BAD_ARGS in its fine-tune step before
    anything trains: nothing changes."""
    dev = detector_device
    dev.install()
    before = tree_digest(dev.state / "models")
    npz = tmp_path / "digits.npz"
    np.savez(npz, x=np.zeros((4, 8, 8), np.float32), y=np.arange(4))
    for job_id, over, says in (
            ("e2", {"data": str(npz)}, ("a detection model trains on a COCO folder",
                                        "or a YOLO folder")),):
        rec, out = run_job(dev, job_id, **over)
        assert rec.state is JobState.FAILED and rec.error["code"] == "BAD_ARGS", rec.error
        assert all(x in rec.error["message"] for x in says), rec.error["message"]
        assert out["finetune"]["status"] == "failed" and "export" not in out
        assert not (dev.state / "jobs" / job_id / "finetune").exists()  # nothing trained
    assert tree_digest(dev.state / "models") == before


def test_exporting_a_detector_family_without_an_export_is_refused_with_the_fix() -> None:
    from exporters.job import unexportable

    why = unexportable("detection", "torchvision/retinanet_resnet18_fpn")
    assert why is not None and "has no ONNX export yet" in why
    assert "steps.export: false" in why


def test_a_detector_evaluated_for_the_fleet_reports_its_map(
        detector_device: DetectorDevice) -> None:
    """An ``evaluate`` job (fleet learning's federated evaluation) of a detector: the
    candidate and the baseline scored by mAP on the same held-out images, as the fleet's
    device gates read it (``fleet.learn.evaluations``), nothing installed."""
    from agent.jobs.evaluate_spec import EvaluateJob
    from fleet.learn.evaluations import _DeviceEvaluation

    dev = detector_device
    dev.install()
    before = tree_digest(dev.state / "models")
    spec = EvaluateJob(model="det", version="v1", data=dev.data, registry=dev.registry.url,
                       trusted_keys=dev.state / "trusted_keys")
    store = JobStore(dev.state)
    store.submit("ev", "evaluate", spec.model_dump(mode="json"))
    store.close()
    r = worker(dev.state, "ev", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    store = JobStore(dev.state)
    rec = store.get("ev")
    store.close()
    assert rec is not None and rec.state is JobState.SUCCEEDED, rec and rec.error
    ev = rec.result["evaluation"]
    assert ev["gate_metric"] == "map" and ev["accuracy"] is None and ev["samples"] == 7  # 0.3
    # The candidate is the active version: the same weights, the same mAP.
    assert ev["metric"] == ev["candidate"]["metric"] == ev["baseline"]["metric"]
    assert ev["gain_pts"] == 0 and ev["candidate"]["finite"]
    assert rec.result["metrics_after"] == {"eval/map": ev["metric"]}
    assert rec.result["gate_metric"] == "eval/map"
    read = _DeviceEvaluation.model_validate({**ev, "version": "v1",
                                             "baseline": {**ev["baseline"], "version": "v1"}})
    assert read.accuracy == ev["metric"] and read.baseline.accuracy == ev["metric"]
    assert tree_digest(dev.state / "models") == before


def test_a_detector_job_it_cannot_run_is_refused_when_submitted(
        detector_device: DetectorDevice, tmp_path: Path) -> None:
    """With the detector installed, the daemon's command (``resolve``: ArgsRefused, the
    command REJECTED) and ``agentctl finetune`` (preflight: exit 2) refuse classification
    data at once, torch-free, naming the field and the fix; an export is taken."""
    import shutil

    from agent.jobs.preflight import check_inputs
    from agent.jobs.resolve import ArgsRefused, DeviceSettings, resolve
    from agent.jobs.spec import FinetuneArgs

    dev = detector_device
    dev.install()
    root = tmp_path / "data_root"
    shutil.copytree(dev.data, root / "cam0")
    np.savez(root / "digits.npz", x=np.zeros((4, 8, 8), np.float32), y=np.arange(4))
    settings = DeviceSettings(state_dir=dev.state, data_root=root, registry=dev.registry.url,
                              upload_registry=None, trusted_keys=dev.state / "trusted_keys",
                              signing_key=dev.state / "device.key.pem")
    args = {"model": "det", "data": "cam0", "steps": {"export": False}}
    job = resolve("finetune", FinetuneArgs.model_validate(args), settings)
    assert isinstance(job, DeviceJob) and job.data == root / "cam0"
    for over, field, says in (({"data": "digits.npz"}, "data", "a COCO folder"),):
        with pytest.raises(ArgsRefused, match=says) as e:
            resolve("finetune", FinetuneArgs.model_validate({**args, **over}), settings)
        assert e.value.field == field
    exported = resolve("finetune", FinetuneArgs.model_validate(
        {**args, "steps": {"export": True}}), settings)
    assert isinstance(exported, DeviceJob) and exported.steps.export
    check_inputs(DeviceJob.model_validate(dev.spec(steps={"export": True})), dev.state)
    check_inputs(DeviceJob.model_validate(dev.spec()), dev.state)
