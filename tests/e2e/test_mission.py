"""The whole mission as a user runs it: ``scripts/demo.py`` (what ``make demo`` runs), then
every claim checked through the public interfaces only — the CLIs (agentctl, fleetctl),
HTTP (``python -m registry.serve``) and files the tools document. No project module is
imported here.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODEL = "digits-cnn"
DEVICES = ("edge-1", "edge-2", "edge-3")
NEW_DEVICE = "edge-4"
"""Outside the rollout and the learning round; the round's release is deployed to it."""
DET_MODEL, DET_DEVICE = "camera-det", "cam-1"
"""The detector's group: one device, its camera mounted 90 degrees off."""

pytestmark = [
    pytest.mark.slow,
    # The demo alone takes ~8-9 min beside the rest of the suite on 2 cores; a slower host
    # passed 600 s. Its own subprocess timeout (1,200 s) is what bounds it.
    pytest.mark.timeout(1300),
    pytest.mark.skipif(shutil.which("mosquitto") is None,
                       reason="mosquitto is not installed (make services installs it)"),
]


@pytest.fixture(scope="module")
def mission(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    out = tmp_path_factory.mktemp("mission") / "demo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "scripts/demo.py", "--out", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=1200)
    log = p.stdout + p.stderr
    (out.parent / "demo.log").write_text(log)
    assert p.returncode == 0, log[-6000:]
    yield out, log


def _cli(*argv: str, ok: int | None = 0) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=300)
    if ok is not None:
        assert p.returncode == ok, f"{argv}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def _finetune_job(state: Path) -> dict:
    jobs = [json.loads(line) for line in
            _cli("agentctl", "jobs", "--json", "--state-dir", str(state)).stdout.splitlines()
            if line.strip()]
    finetunes = [j for j in jobs if j["type"] == "finetune"]
    assert len(finetunes) == 1, jobs  # each device ran its execution exactly once
    shown = json.loads(_cli("agentctl", "job", finetunes[0]["id"], "--json", "--state-dir",
                            str(state)).stdout)
    return dict(shown["job"])


def test_every_process_the_demo_started_has_exited(mission: tuple[Path, str]) -> None:
    out, _ = mission
    pids = [line.split() for line in (out / "pids").read_text().splitlines()]
    # Each device's application runtime (agentctl serve) is one of them.
    assert {who for _, who in pids} >= {"registry", "broker", *DEVICES, NEW_DEVICE, DET_DEVICE,
                                        *(f"app-{d}" for d in (*DEVICES, DET_DEVICE))}
    alive = []
    for pid, who in pids:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()
        if stat[0] != "Z":  # a zombie has exited; its parent (pytest's child) is gone
            alive.append((pid, who))
    assert not alive


def test_each_device_fine_tuned_committed_and_uploaded(mission: tuple[Path, str]) -> None:
    out, log = mission
    for dev in DEVICES:
        state = out / "devices" / dev / "state"
        job = _finetune_job(state)
        assert job["state"] == "SUCCEEDED", job
        r = job["result"]
        assert r["outcome"] == "committed", r
        before, after = r["metrics_before"]["eval/acc"], r["metrics_after"]["eval/acc"]
        assert after >= before, (dev, before, after)  # the health gate: no drop
        # INT8 with no layer left in float, on whatever CPU runs this (int8-s8s8: the fast
        # recipe of an x86 host without VNNI missed its gate and symmetric int8 passed).
        assert r["export"]["winner"] in ("int8", "int8-s8s8"), r["export"]
        assert r["export"]["excluded_layers"] == [], r["export"]
        assert abs(r["export"]["int8_drop_pts"]) <= 1.0
        assert r["memory"]["peak_tree_mb"] <= 1.05 * r["memory"]["budget_mb"]
        assert r["uploaded"]["parent"] == "1"
        assert r["model"]["version"] == r["uploaded"]["version"]
        models = _cli("agentctl", "models", "--state-dir", str(state)).stdout
        assert f"active {r['uploaded']['version']}" in models, models
        assert dev in log
    # The inverted + noisy camera starts far off: the fine-tune must win it back.
    r1 = _finetune_job(out / "devices/edge-1/state")["result"]
    assert r1["metrics_after"]["eval/acc"] - r1["metrics_before"]["eval/acc"] >= 0.20


def test_the_rollout_went_in_two_waves_and_succeeded(mission: tuple[Path, str]) -> None:
    out, log = mission
    fleet = ["fleetctl", "--db", str(out / "fleet.db"), "--report-dir", str(out / "reports")]
    status = json.loads(_cli(*fleet, "rollout", "status", "demo", "--json").stdout)
    assert status["state"] == "succeeded", status
    assert [w["devices"] for w in status["waves"]] == [1, 2]
    assert all(w["succeeded"] == w["devices"] for w in status["waves"])
    assert (out / "reports/demo.png").stat().st_size > 0
    for dev in DEVICES:
        assert f"{dev}" in log and "report:" in log


def _summary_table(log: str, title: str, devices: tuple[str, ...] = DEVICES
                   ) -> dict[str, dict[str, str]]:
    """A table of the demo's summary, by device: its header (starting with ``title``), a rule,
    then one row per device; columns are at least two spaces apart."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] not in devices:
            break
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    assert set(rows) == set(devices), lines[start:start + 2 + len(devices)]
    return rows


def test_the_application_lost_no_request_across_the_swap(mission: tuple[Path, str]) -> None:
    """Each device's application was served all through its fine-tune, and was answered by
    the version its device committed from the swap on, with not one request failed."""
    _, log = mission
    committed = _summary_table(log, "device  camera")  # the classifiers', printed first
    committed.update(_summary_table(log, "device  camera  mAP", (DET_DEVICE,)))
    app = _summary_table(log, "device  requests", (*DEVICES, DET_DEVICE))
    for dev in (*DEVICES, DET_DEVICE):
        model = DET_MODEL if dev == DET_DEVICE else MODEL
        version = committed[dev]["committed"].removeprefix(f"{model}@")
        assert version.startswith(f"1+{dev}."), committed[dev]
        row = app[dev]
        assert int(row["failed"]) == 0, row
        served = {v: int(n) for v, n in
                  re.findall(r"(\S+) \((\d+)\)", row["answered by version (requests)"])}
        assert set(served) == {"1", version}, row  # the upstream, then the device's own
        assert served[version] > 0 and served["1"] > 0, row
        assert sum(served.values()) == int(row["requests"]), row  # every request answered
    assert re.search(rf"^application: \d+ requests, 0 failed; {len(DEVICES) + 1} swaps", log,
                     re.M), log[-3000:]
    assert "application FAILED" not in log


def test_the_detector_fine_tuned_for_its_camera_and_serves_int8_boxes(
        mission: tuple[Path, str]) -> None:
    """The detector's group: its rollout's job fine-tuned upstream's SSDlite on what the
    device's rotated camera sees, exported it to INT8 with NMS in the graph losing at most a
    point of the FP32 model's mAP@0.5, health-checked the exported file by mAP in ONNX Runtime,
    committed and uploaded it; the summary's row is that job's, and the application was
    served boxes by the four typed outputs all through (the lost-nothing test above covers
    its requests and swap)."""
    out, log = mission
    state = out / "devices" / DET_DEVICE / "state"
    job = _finetune_job(state)
    assert job["state"] == "SUCCEEDED", job
    r = job["result"]
    assert r["outcome"] == "committed" and r["gate_metric"] == "eval/map", r
    # The camera costs upstream's model most of what it finds; the fine-tune wins some back.
    before, after = r["metrics_before"]["eval/map"], r["metrics_after"]["eval/map"]
    assert after > before, (before, after)
    ex = r["export"]
    # At most a point lost to INT8. It may also score above FP32 on the device's few held-out
    # frames (a run saw +1.18 points, with its gated mAP@0.5:0.95 within 0.49): rounding noise,
    # bounded at three points so a graph that scores something else still fails.
    assert ex["winner"].startswith("int8") and -3.0 <= ex["map50_drop_pts"] <= 1.0, ex
    h = r["health"]
    assert h["staged"]["runtime"].startswith("onnxruntime") and h["passed"], h
    a50, s50 = h["active"]["metrics"]["map50"], h["staged"]["metrics"]["map50"]
    assert s50 > a50, (a50, s50)
    version = r["model"]["version"]
    assert r["uploaded"] == {"name": DET_MODEL, "version": version, "parent": "1"}, r
    models = _cli("agentctl", "models", "--state-dir", str(state)).stdout
    assert f"{DET_MODEL}: active {version} " in models, models
    row = _summary_table(log, "device  camera  mAP", (DET_DEVICE,))[DET_DEVICE]
    assert row["mAP@0.5 before -> after"] == f"{a50:.3f} -> {s50:.3f}", row
    assert row["mAP@0.5:0.95"] == f"{before:.3f} -> {after:.3f}", row
    assert row["INT8 mAP@0.5 drop"] == f"{ex['map50_drop_pts']:+.2f} pts", row
    assert row["committed"] == f"{DET_MODEL}@{version}", row
    assert re.search(rf"{DET_DEVICE} +app: agentctl serve {DET_MODEL}@1 \(onnxruntime_onnx, "
                     r"input \[1, 3, 160, 160\]; outputs num_detections \[-1, 1\], "
                     r"boxes \[-1, 100, 4\], scores \[-1, 100\], classes \[-1, 100\]\)",
                     log), log[-3000:]


def test_the_served_detector_answers_as_its_onnx_file_does(mission: tuple[Path, str]) -> None:
    """``agentctl serve`` on the detector's device, after the demo: one of the device's own
    frames in, the four outputs out, equal to ONNX Runtime's run of the file the device
    committed (NMS in the graph: boxes, scores, classes, the count)."""
    import numpy as np
    import onnxruntime as ort
    from PIL import Image

    out, _ = mission
    home = out / "devices" / DET_DEVICE
    frame_png = sorted((home / "data/camera/images").glob("*.png"))[0]
    frame = (np.asarray(Image.open(frame_png).convert("RGB"), dtype=np.float32) / 255.0
             ).transpose(2, 0, 1)[None].copy()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(BIN / "agentctl"), "serve", "--state-dir", str(home / "state"),
                               "--model", DET_MODEL, "--port", str(port), "--threads", "1",
                               "--log-format", "text"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/v2/health/ready")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "serve not ready"
            time.sleep(0.2)
        meta_req = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        meta_req.request("GET", f"/v2/models/{DET_MODEL}")
        meta = json.loads(meta_req.getresponse().read())
        name = meta["inputs"][0]["name"]
        body = json.dumps({"inputs": [{"name": name, "shape": list(frame.shape),
                                       "datatype": "FP32", "data": frame.ravel().tolist()}]})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", f"/v2/models/{DET_MODEL}/infer", body,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 200, answer
    finally:
        server.terminate()
        server.wait(30)
    served = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}
    committed = (home / "state/models" / DET_MODEL / "current").resolve()
    assert answer["model_version"] == json.loads((committed / "manifest.json").read_text())[
        "version"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(committed / "artefacts/model.onnx"), opts,
                                   providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in session.get_outputs()], session.run(None, {name: frame}),
                   strict=True))
    assert list(served) == ["num_detections", "boxes", "scores", "classes"]
    n = int(ref["num_detections"][0, 0])
    assert n > 0 and int(served["num_detections"][0, 0]) == n
    np.testing.assert_allclose(served["boxes"], ref["boxes"], atol=1e-3)
    np.testing.assert_allclose(served["scores"], ref["scores"], atol=1e-5)
    np.testing.assert_array_equal(served["classes"], ref["classes"])


@pytest.fixture(scope="module")
def registry_url(mission: tuple[Path, str]) -> Iterator[str]:
    out, _ = mission
    p = subprocess.Popen([sys.executable, "-m", "registry.serve", str(out / "registry")],
                         cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        yield p.stdout.readline().strip()
    finally:
        p.terminate()
        p.wait(10)


def _weights_hash(manifest: dict) -> str:
    """One hash over every tensor's name, dtype, shape and sha256: the model's identity."""
    rows = sorted((t["name"], t["dtype"], t["shape"], t["sha256"]) for t in manifest["tensors"])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _get(url: str, path: str) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, (path, resp.status)
        return body
    finally:
        conn.close()


def test_uploads_are_signed_children_of_the_upstream_version(
    mission: tuple[Path, str], registry_url: str, tmp_path: Path
) -> None:
    out, _ = mission
    for dev in DEVICES:
        state = out / "devices" / dev / "state"
        version = _finetune_job(state)["result"]["uploaded"]["version"]
        manifest = _get(registry_url, f"/{MODEL}/{version}/manifest.json")
        assert json.loads(manifest)["parent"] == "1"
        # The model committed on the device is the version it uploaded: same name, same
        # weights (every tensor's sha256); the registry gave it its own sequence number.
        current = (state / "models" / MODEL / "current").resolve()
        local = json.loads((current / "manifest.json").read_bytes())
        remote = json.loads(manifest)
        assert (local["name"], local["version"]) == (remote["name"], remote["version"])
        assert _weights_hash(local) == _weights_hash(remote)
        assert remote["sequence"] > 1
        # Its signature verifies with the device's key, and with nothing else.
        trusted = tmp_path / dev / "trusted"
        trusted.mkdir(parents=True)
        shutil.copy(out / "keys/upstream.pub.pem", trusted)
        pull = ["agentctl", "pull", f"{MODEL}@{version}", "--registry", registry_url,
                "--trusted-keys", str(trusted), "--no-progress"]
        refused = _cli(*pull, "--state-dir", str(tmp_path / dev / "s1"), ok=None)
        assert refused.returncode == 3, refused.stderr
        for f in (state / "trusted_keys").glob(f"{dev}.*"):
            shutil.copy(f, trusted)
        _cli(*pull, "--state-dir", str(tmp_path / dev / "s2"))


def test_the_fleet_learned_from_the_uploads_in_one_round(
    mission: tuple[Path, str], registry_url: str
) -> None:
    """The learning round combined the three uploads of the rollout (no device fine-tuned
    again), each device scored the candidate without installing it, and upstream published
    the aggregate as release 2, signed, with its lineage; it beats the base on the devices'
    data."""
    out, log = mission
    fleet = ["fleetctl", "--db", str(out / "fleet.db"), "--report-dir", str(out / "reports")]
    s = json.loads(_cli(*fleet, "learn", "status", "fleet", "--json").stdout)
    assert s["state"] == "finished", s
    (r1,) = s["history"]
    assert (r1["outcome"], r1["release"], r1["base"]) == ("published", "2", "1"), r1
    assert r1["updates"]["combined"] == len(DEVICES) and r1["updates"]["skipped"] == 0, r1
    assert sorted(e["device"] for e in r1["evaluations"]) == sorted(DEVICES)
    assert all(g["passed"] for g in r1["gates"]), r1["gates"]
    assert r1["evaluation"]["mean_gain_pts"] > 0, r1["evaluation"]
    uploaded = sorted(_finetune_job(out / "devices" / d / "state")["result"]["uploaded"]
                      ["version"] for d in DEVICES)  # one fine-tune each: none ran again
    manifest = json.loads(_get(registry_url, f"/{MODEL}/2/manifest.json"))
    assert (manifest["parent"], manifest["signer"]["name"]) == ("1", "upstream")
    assert sorted(manifest["training"]["aggregate"]["combined"]) == uploaded
    for dev in DEVICES:  # scored on the device, installed nowhere
        state = out / "devices" / dev / "state"
        jobs = [json.loads(line) for line in _cli("agentctl", "jobs", "--json", "--state-dir",
                                                  str(state)).stdout.splitlines() if line.strip()]
        assert [j["state"] for j in jobs if j["type"] == "evaluate"] == ["SUCCEEDED"], jobs
        models = _cli("agentctl", "models", "--state-dir", str(state)).stdout
        assert "active 2 " not in models and "standby 2;" not in models, models
    # The summary's table: per device the base, the aggregate (as the device scored it), the
    # aggregate with the device's own head (personalized, scored by the same job) and the
    # device's own fine-tune (as its job reported it).
    start = next(i for i, line in enumerate(log.splitlines())
                 if line.startswith("device") and "own fine-tune" in line)
    scored = {e["device"]: e for e in r1["evaluations"]}
    for line in log.splitlines()[start + 2:start + 2 + len(DEVICES)]:
        dev, _, base, cand, pers, own = re.split(r"\s{2,}", line.strip())
        after = _finetune_job(out / "devices" / dev / "state")["result"]["metrics_after"]
        assert scored[dev]["personalized_accuracy"] is not None, scored[dev]
        assert (base, cand, pers, own) == (
            f"{100 * scored[dev]['base_accuracy']:.1f}%",
            f"{100 * scored[dev]['candidate_accuracy']:.1f}%",
            f"{100 * scored[dev]['personalized_accuracy']:.1f}%",
            f"{100 * after['eval/acc']:.1f}%"), line
    assert re.search(rf"^fleet learning: {MODEL}@1 -> {MODEL}@2 on the union of the devices' "
                     r"data [\d.]+% -> [\d.]+%", log, re.M), log[-3000:]
    assert (out / "reports/learn-fleet.png").read_bytes()[:4] == b"\x89PNG"


def test_the_release_was_deployed_to_a_new_device_and_helps_it(
    mission: tuple[Path, str], registry_url: str
) -> None:
    """A device outside the round (its own group, a camera like edge-1's) ran one job, the
    deploy of release 2: verified, staged, health-checked on its own held-out data against
    the upstream model it had, committed; the summary's figures are that job's."""
    out, log = mission
    state = out / "devices" / NEW_DEVICE / "state"
    jobs = [json.loads(line) for line in _cli("agentctl", "jobs", "--json", "--state-dir",
                                              str(state)).stdout.splitlines() if line.strip()]
    assert [(j["type"], j["state"]) for j in jobs] == [("deploy", "SUCCEEDED")], jobs
    job = json.loads(_cli("agentctl", "job", jobs[0]["id"], "--json", "--state-dir",
                          str(state)).stdout)["job"]
    r = job["result"]
    assert r["outcome"] == "committed" and r["model"]["version"] == "2", r
    before, after = r["metrics_before"]["eval/acc"], r["metrics_after"]["eval/acc"]
    assert after > before, r  # what the fleet learned helps a camera it never saw
    models = _cli("agentctl", "models", "--state-dir", str(state)).stdout
    assert f"{MODEL}: active 2 " in models and "standby 1;" in models, models
    # Installed as released: the weights are the registry's release 2.
    remote = json.loads(_get(registry_url, f"/{MODEL}/2/manifest.json"))
    local = json.loads(((state / "models" / MODEL / "current").resolve() / "manifest.json")
                       .read_bytes())
    assert _weights_hash(local) == _weights_hash(remote)
    assert re.search(rf"^deployed: {MODEL}@2 on {NEW_DEVICE} \(a new device, camera "
                     rf"invert,noise\): {100 * before:.1f}% -> {100 * after:.1f}% on its own "
                     "held-out data", log, re.M), log[-3000:]
