"""The whole mission on one machine, as ``make demo`` runs it.

1. upstream: ``torchrun`` trains small_cnn on digits with 2 DDP processes (gloo, CPU), and
   ``agentctl export`` makes its INT8 ONNX file, the release's serving artefact;
2. registry: ``hpc-train keygen`` + ``publish`` a signed version (weights and ONNX file),
   served over loopback HTTP by ``python -m registry.serve``; each device gets its own upload
   token (``registry.serve add-principal``) and may write only its own versions;
3. broker: a throwaway mosquitto provisioned by ``fleetctl broker-config`` from an inventory:
   one account per device (its client id), an ACL that keeps each device to its own topics and
   its groups' commands, and an account per operator tool on a listener of their own;
4. devices: three ``edge-agent`` daemons in the fleet's group and a fourth in a group of its
   own, on the simulated board (``sim`` profile and sensors), each provisioned with
   ``agentctl pull`` and given its own camera's data (the documented distortions of digits, a
   different one per device), and a p99 latency SLO for its application (``latency_slo_ms``
   in agent.yaml);
5. application: on each device ``agentctl serve`` serves the committed model over the Open
   Inference Protocol (loopback HTTP), and a client in this script sends it
   ``POST /v2/models/MODEL/infer`` at a fixed rate (batch 1, the frame as raw float32: the
   protocol's binary tensor data extension), counting answers, failures and the model version
   that answered each request;
6. fleet: ``fleetctl rollout create`` runs a ``finetune`` job in two waves (a canary, then
   the rest): pull -> fine-tune under the memory budget and the governor -> INT8 export with
   gates -> stage -> health -> commit -> upload of each device's signed delta. The
   application keeps being served throughout: while its p99 is over the SLO the governor
   lowers the fine-tune's duty (limit "latency"), and at commit the runtime swaps to the new
   version between two requests;
7. fleet learning: ``fleetctl learn`` runs one round on those uploads (``--first-updates``:
   the devices do not fine-tune again): ``hpc-train aggregate`` verifies and combines the
   three signed deltas (fedavg, weighted by samples), the candidate is published and scored
   on each device's held-out data by an ``evaluate`` job (installing nothing), and, past the
   device gate, published as the next upstream release (``digits-cnn@2``), signed, with its
   lineage; then deployed to a fourth device that joined outside the round (its own group,
   an inverted + noisy camera like edge-1's, upstream's model installed): health-checked on
   its own data against that model, committed. The summary shows the base, the aggregate and
   each device's own fine-tune on each device's held-out data and on their union, and what
   the release did for the new device; each device also scores the aggregate with its own
   head in place (``--eval-personal head``: personalized, FedPer's way);
8. a detector's group: ``hpc-train train --config configs/detection_demo.yaml`` trains an
   SSDlite at 160 px beside the classifier's export, ``agentctl export`` makes its INT8 file
   with NMS in the graph (gated by mAP@0.5), published as ``camera-det@1``; a fifth device,
   ``cam-1`` (group ``cameras``, a camera mounted 90 degrees off), serves it to its
   application (boxes, scores, classes) and, after the classifiers' rollout, gets its own:
   fine-tune on its images -> INT8 gated by mAP@0.5 -> health by mAP -> commit -> upload; the
   summary's detector row has its mAP before and after.

Everything is driven through the command lines, MQTT and HTTP, as an operator would. The live
view below follows the devices over MQTT (the fleet's operator account): temperature, the
fine-tune's duty and what limits it, the application's p99 and request count. The summary
gives each device's requests sent, failed and the versions that answered them; the demo exits
non-zero when the application lost a request or never got an answer from the version its
device committed. Every process it starts is stopped on exit, also on Ctrl-C. Re-running
starts from scratch in ``--out``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import yaml

from contract import JobOutcome, Result, Status, Telemetry, Topics
from registry.atomic import private_umask
from registry.credentials import REGISTRY_ENV, TOKEN_ENV

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "digits-cnn"
DEVICES = {  # device id -> the camera it sees (scripts/make_device_data.py distortions)
    "edge-1": "invert,noise",
    "edge-2": "rotate",
    "edge-3": "blur,noise",
}
GROUP = "demo"
NEW_DEVICE, NEW_CAMERA, NEW_GROUP = "edge-4", "invert,noise", "new"
"""A device outside the rollout and the learning round (its own group): the same kind of
camera as edge-1 (another unit, its own images and noise), upstream's model installed. The
round's release is deployed to it: what the fleet learned is what a new device starts from."""
LEARN = "fleet"
"""The learning round's name: it publishes ``fleet-r1-candidate``, then, numbered as upstream
numbers its releases, ``2``."""
LEARN_MAX_DROP_PTS = 10.0
"""The device gate: the aggregate is released only if no device's held-out accuracy drops
more than this many points below the base's."""
DET_MODEL = "camera-det"
DET_DEVICE, DET_CAMERA, DET_GROUP = "cam-1", "rotate", "cameras"
"""The detector's group: one device whose camera is mounted 90 degrees off, running upstream's
detector (configs/detection_demo.yaml: SSDlite at 160 px, 5 classes) until its own rollout
fine-tunes it on what that camera sees."""
DET_CONFIG = "configs/detection_demo.yaml"
DET_SET = ["--size", "160", "--classes", "digit_2,digit_4,digit_7,square,triangle",
           "--objects", "1,4", "--object-size", "0.2,0.45"]
"""scripts/make_detection_data.py's flags for the device's images: the config's set."""
DET_ARGS: dict[str, Any] = {
    "model": DET_MODEL, "data": "camera",  # a COCO folder under the device's data_root
    "finetune": {"steps": 30, "effective_batch": 16, "trainable": "all", "lr": 0.001,
                 "budget_mb": 1200, "val_fraction": 0.25, "sim_time_scale": 300},
    # Gated by mAP@0.5 (within 1 point of the fine-tuned FP32 model), NMS in the graph.
    "export": {"calibration": {"samples": 32}, "gates": {"latency_iters": 20},
               "fallback": {"sensitivity_samples": 32}},
    "steps": {"upload": True},
}
"""The detector's rollout: 30 device steps of 16 images, INT8 export, health by mAP."""
APP_DEVICES = [*DEVICES, DET_DEVICE]
"""The devices whose application this script plays (edge-4 serves nothing here)."""


def model_of(dev: str) -> str:
    return DET_MODEL if dev == DET_DEVICE else MODEL


def slo_of(dev: str) -> float:
    return DET_APP_SLO_MS if dev == DET_DEVICE else APP_SLO_MS
APP_RATE_HZ = 20.0
"""Requests a second each device's application sends (batch 1, one at a time)."""
DET_APP_RATE_HZ = 2.0
"""The detector's application: a 160 px frame is 77k numbers, ~0.5 MB of JSON a request."""
DET_APP_SLO_MS = 50.0
"""Its p99 objective: the INT8 detector answers a frame in ~4 ms and decoding the frame's
JSON takes longer; its p99 is 10-15 ms beside a fine-tune (at 3 ms the governor held the
detector's fine-tune at duty 0 for minutes)."""
APP_SLO_MS = 3.0
"""The application's p99 objective (agent.yaml ``latency_slo_ms``, ``serve --slo-ms``). The
model answers a batch of 1 in ~0.1 ms; the p99 the runtime reports over its 10 s window is
about 1-2 ms beside one fine-tune on 2 cores, and 3-5 ms when two fine-tunes or a fine-tune's
set-up run beside it on a busy machine. At 3 ms the governor's latency limit lowers the duty
there for seconds; at 1 ms it held the fine-tunes at 5% duty for minutes. A machine with cores
to spare stays under it, and the fine-tunes run at full duty."""
APP_SWAP_WAIT_S = 20.0
"""After the rollout, how long the applications may take to be answered by the versions their
devices committed (the runtime polls every 0.2 s and warms a new version before the swap)."""


class DemoError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class View:
    """Timestamped, aligned lines: readable live at a terminal and in a CI log alike."""

    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, who: str, text: str) -> None:
        with self.lock:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {who:<9} {text}", flush=True)


class AppLoad:
    """One device's application: Open Inference Protocol requests to its ``agentctl serve``
    at a fixed rate over one keep-alive connection (a camera sending frames), counting what
    was sent, what failed and which model version answered each request."""

    def __init__(self, dev: str, port: int, say: View, model: str = MODEL,
                 rate_hz: float = APP_RATE_HZ) -> None:
        self.dev, self.port, self.say, self.period_s = dev, port, say, 1.0 / rate_hz
        self.model, self.rate_hz = model, rate_hz
        self.sent = self.failed = 0
        self.versions: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"app-{dev}", daemon=True)
        self._conn: http.client.HTTPConnection | None = None
        self._body, self._head_len = b"", 0

    def wait_ready(self, timeout_s: float) -> bool:
        """Until the server says a version serves (GET /v2/health/ready answers 200)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self._call("GET", "/v2/health/ready")[0] == 200:
                    return True
            except (OSError, http.client.HTTPException):
                self._conn = None  # not listening yet
            time.sleep(0.1)
        return False

    def start(self) -> str:
        """Shape the request from the model's metadata, then send from a thread; returns what
        the metadata says is served."""
        status, meta = self._call("GET", f"/v2/models/{self.model}")
        if status != 200:
            raise DemoError(f"{self.dev}: GET /v2/models/{self.model} answered {status}: "
                            f"{meta}")
        inp = meta["inputs"][0]
        shape = [1 if d < 0 else d for d in inp["shape"]]  # batch 1; the rest is fixed
        rng = random.Random(self.dev)  # one fixed frame per device: only the timing matters
        n = math.prod(shape)
        frame = struct.pack(f"<{n}f", *(rng.random() for _ in range(n)))
        # The frame as raw float32 after the JSON header (the protocol's binary tensor data
        # extension), as a camera sends it: a 160 px RGB frame in JSON numbers is ~0.5 MB of
        # text for the server to parse on every request.
        head = json.dumps({"inputs": [{"name": inp["name"], "shape": shape, "datatype": "FP32",
                                       "parameters": {"binary_data_size": len(frame)}}]}).encode()
        self._body, self._head_len = head + frame, len(head)
        self._thread.start()
        outs = ", ".join(f"{o['name']} {o['shape']}" for o in meta["outputs"])
        return (f"{meta['name']}@{meta['versions'][0]} ({meta['platform']}, input {shape}; "
                f"outputs {outs})")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self._conn is not None:
            self._conn.close()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self._infer()
            due += self.period_s
            now = time.monotonic()
            if now - due > 1.0:  # fell a second behind (a starved CPU): drop the backlog
                due = now
            self._stop.wait(max(0.0, due - now))

    def _infer(self) -> None:
        self.sent += 1
        try:
            status, out = self._call("POST", f"/v2/models/{self.model}/infer", self._body)
            if status != 200:
                self._fail(f"HTTP {status}: "
                           f"{out.get('error') if isinstance(out, dict) else out}")
                return
            version = str(out["model_version"])
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            self._fail(f"{type(e).__name__}: {e}")
            return
        if self.versions and version not in self.versions:  # the runtime swapped
            self.say(self.dev, f"app: answered by {self.model}@{version} from request "
                               f"{self.sent} on ({self.failed} failed so far)")
        self.versions[version] += 1

    def _fail(self, why: str) -> None:
        self.failed += 1
        if not self.errors:
            self.say(self.dev, f"app: request {self.sent} FAILED: {why}")
        self.errors[why] += 1
        if self._conn is not None:  # a fresh connection for the next request
            self._conn.close()
            self._conn = None

    def _call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = ({"Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(self._head_len)} if body else {})
        self._conn.request(method, path, body, headers)
        r = self._conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None


class Mission:
    def __init__(self, out: Path, view: View, job_args: dict[str, Any]) -> None:
        self.out, self.say, self.job_args = out, view, job_args
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        for var in (TOKEN_ENV, REGISTRY_ENV):  # each device gets its own, nothing else any
            self.env.pop(var, None)
        self.registry_url = ""
        self.registry_lock = threading.Lock()
        self.broker_port = self.operator_port = 0
        self.secrets = out / "secrets"
        """Broker passwords (``fleetctl broker-config --secrets``): devices/, operators/."""
        self.results: dict[str, dict[str, Any]] = {}
        self.stage: dict[str, str] = {}
        self.last_step: dict[str, tuple[Any, ...]] = {}
        self.mq: mqtt.Client | None = None
        self.app_ports: dict[str, int] = {}
        self.apps: dict[str, AppLoad] = {}
        self.learn_status = ""
        """``fleetctl learn status`` once the learning round ended."""
        self.finetunes: dict[str, JobOutcome] = {}
        """The rollout's outcomes, kept before the learning round's jobs report."""
        self.learn_round: dict[str, Any] = {}
        """Its round, as ``fleetctl learn status --json`` shows it."""

    # --- processes -----------------------------------------------------------------------

    def run(self, who: str, argv: list[str], **kw: Any) -> str:
        """Run a command to completion; its output is shown only when it fails."""
        p = subprocess.run(argv, env=self.env, capture_output=True, text=True, **kw)
        if p.returncode != 0:
            raise DemoError(f"{who}: {' '.join(argv[:4])} ... exit {p.returncode}\n"
                            f"{p.stdout[-2000:]}{p.stderr[-3000:]}")
        return p.stdout

    def start(self, who: str, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            p = subprocess.Popen(argv, env=kw.pop("env", self.env), stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.procs.append((who, p))
        (self.out / "pids").open("a").write(f"{p.pid} {who}\n")
        return p

    def stop_all(self) -> None:
        for app in self.apps.values():  # before the servers, or their exit would count
            app.stop()
        if self.mq is not None:
            self.mq.loop_stop()
            self.mq.disconnect()
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for who, p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(who, "did not stop in 30 s: killed")
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # --- 1. upstream ---------------------------------------------------------------------

    def train_upstream(self) -> Path:
        run = self.out / "upstream"
        self.say("upstream", "torchrun: small_cnn on digits, 2 DDP processes (gloo on CPU)")
        self.run("upstream", [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                              "-m", "hpc_core.train", "--config", "configs/digits.yaml",
                              "--set", f"run.output_dir={run}", "--set", "logging.progress=off"],
                 cwd=REPO, timeout=600)
        evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        acc = [m["eval/acc"] for m in evals if "eval/acc" in m]
        self.say("upstream", f"trained: validation accuracy {acc[-1]:.1%} after "
                             f"{len(acc)} epochs -> {run}/checkpoints/final")
        return run

    def start_detector_training(self) -> subprocess.Popen[bytes]:
        """The fleet's detector, trained beside the classifier's export (one core each)."""
        run = self.out / "upstream-det"
        run.mkdir()
        self.say("upstream", f"hpc-train train: {DET_MODEL} ({DET_CONFIG}: SSDlite from "
                             "scratch at 160 px, 300 steps), one process")
        return self.start("upstream", [str(BIN / "hpc-train"), "train", "--config", DET_CONFIG,
                                       "--set", f"run.output_dir={run}",
                                       "--set", "logging.progress=off"],
                          run / "train.log", cwd=REPO)

    def detector_trained(self, proc: subprocess.Popen[bytes]) -> Path:
        run = self.out / "upstream-det"
        if proc.wait() != 0:
            raise DemoError(f"upstream: hpc-train train {DET_CONFIG} ... exit {proc.returncode}"
                            f"\n{(run / 'train.log').read_text()[-3000:]}")
        evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        last = [m for m in evals if "eval/map50" in m][-1]
        self.say("upstream", f"trained {DET_MODEL}: mAP@0.5 {last['eval/map50']:.3f} "
                             f"(mAP@0.5:0.95 {last['eval/map']:.3f}) on held-out images -> "
                             f"{run}/checkpoints/final")
        return run

    def start_export(self, run: Path, latency_iters: int | None = None
                     ) -> subprocess.Popen[bytes]:
        """The release's serving artefact, gated as a device's own export is: what the
        application serves until its device commits a fine-tune. It takes one core for a
        while; the broker and the devices' keys and data are made beside it. A detector's
        has its NMS in the graph and is gated by mAP@0.5, and is timed over as many runs
        (``latency_iters``) as its device's export times it: 50 runs of its batch of 32 at
        160 px were 11 s of the export's 28."""
        iters = ["--latency-iters", str(latency_iters)] if latency_iters else []
        return self.start("export", [str(BIN / "agentctl"), "export", "--checkpoint", str(run),
                                     "--out", str(run / "export"), "--int8", "--json", *iters],
                          run / "export.log", cwd=REPO)

    def exported(self, run: Path, proc: subprocess.Popen[bytes]) -> Path:
        out = run / "export"
        if proc.wait() != 0:
            raise DemoError(f"upstream: agentctl export ... exit {proc.returncode}\n"
                            f"{(run / 'export.log').read_text()[-3000:]}")
        r = json.loads((out / "report.json").read_text())
        m = next(a for a in r["attempts"] if a["step"] == r["winner"])["measurement"]
        score = (f"mAP@0.5 {m['map50']:.3f} ({m['map50_drop_pts']:+.2f} pts)"
                 if m.get("gate_metric") == "map"
                 else f"top-1 {m['top1']:.1%} ({m['top1_drop_pts']:+.2f} pts)")
        self.say("upstream", f"exported: {r['winner']} ONNX, {score}, batch-1 p50 "
                             f"{m['latency_b1']['p50_ms']:.2f} ms -> {out}/model.onnx")
        return out

    # --- 2. registry ---------------------------------------------------------------------

    def publish_version(self, run: Path, export: Path, model: str) -> None:
        """``model@1``: the checkpoint and its ONNX file, signed by the upstream key, into the
        registry's folder (the server serves what the folder holds)."""
        keys, reg = self.out / "keys", self.out / "registry"
        self.run("registry", [str(BIN / "hpc-train"), "publish", str(run), "--registry",
                              str(reg), "--name", model, "--version", "1",
                              "--sign-key", str(keys / "upstream.key.pem"),
                              "--artefact", str(export / "model.onnx"),
                              "--artefact", str(export / "model.onnx.json")])

    def publish(self, run: Path, export: Path) -> None:
        self.publish_version(run, export, MODEL)
        keys, reg = self.out / "keys", self.out / "registry"
        # Who may upload: upstream (any version its key covers) and, added as each device is
        # provisioned, that device (its own versions only). The server re-reads both files.
        trusted, secrets_dir = self.out / "registry-trusted", self.out / "registry-secrets"
        trusted.mkdir()
        shutil.copy(keys / "upstream.pub.pem", trusted)
        self.add_principal("upstream", "upstream", secrets_dir / "upstream.token")
        server = self.start("registry", [sys.executable, "-m", "registry.serve", str(reg),
                                         "--principals", str(self.out / "principals.yaml"),
                                         "--trusted-keys", str(trusted)],
                            self.out / "registry.log")
        deadline = time.monotonic() + 20
        while not self.registry_url:
            text = (self.out / "registry.log").read_text()
            if text.startswith("http://"):
                self.registry_url = text.splitlines()[0].strip()
            elif server.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"registry server did not start:\n{text}")
            time.sleep(0.05)
        self.say("registry", f"published {MODEL}@1 (weights + ONNX), signed by the upstream "
                             f"key; served at {self.registry_url} (uploads: each principal "
                             "its own token)")

    def publish_detector(self, run: Path, export: Path) -> None:
        self.publish_version(run, export, DET_MODEL)
        self.say("registry", f"published {DET_MODEL}@1 (weights + ONNX with NMS in the graph), "
                             "signed by the upstream key")

    def add_principal(self, name: str, kind: str, token: Path) -> None:
        argv = [sys.executable, "-m", "registry.serve", "add-principal", "--principals",
                str(self.out / "principals.yaml"), "--name", name, "--kind", kind,
                "--token-out", str(token)]
        self.say("registry", self.run("registry", argv, cwd=REPO).strip())

    # --- 3. broker -----------------------------------------------------------------------

    def start_broker(self) -> None:
        """Provisioned as an operator would: ``fleetctl broker-config`` writes mosquitto's
        conf, per-device accounts (client id = account), ACLs and the operator tools' own
        accounts from an inventory; the demo only adds ``user root`` and a log."""
        d = self.out / "broker"
        d.mkdir()
        inventory = d / "inventory.yaml"
        inventory.write_text(yaml.safe_dump(
            {"devices": {**{dev: {"groups": [GROUP]} for dev in DEVICES},
                         NEW_DEVICE: {"groups": [NEW_GROUP]},
                         DET_DEVICE: {"groups": [DET_GROUP]}}}))
        self.broker_port, self.operator_port = free_port(), free_port()
        summary = yaml.safe_load(self.run("broker", [
            str(BIN / "fleetctl"), "broker-config", "--inventory", str(inventory),
            "--out", str(d / "conf"), "--secrets", str(self.secrets),
            "--device-listener", f"127.0.0.1:{self.broker_port}",
            "--operator-listener", f"127.0.0.1:{self.operator_port}"]))
        conf = [Path(summary["conf"]).read_text(), "persistence false", "log_dest stderr",
                "log_type error", "log_type warning"]
        if os.geteuid() == 0:  # else mosquitto drops to its own user and cannot read 0600 files
            conf.append("user root")
        (d / "mosquitto.conf").write_text("\n".join(conf) + "\n")
        self.start("broker", ["mosquitto", "-c", str(d / "mosquitto.conf")], d / "log")
        _wait_port(self.broker_port, 10)
        _wait_port(self.operator_port, 10)
        self.say("broker", f"mosquitto: devices on 127.0.0.1:{self.broker_port} (one account "
                           "each = its client id; writes only fleet/v1/dev/<id>/#, reads its "
                           f"own and group '{GROUP}' commands), operator tools on "
                           f"127.0.0.1:{self.operator_port}: "
                           + "; ".join(f"{u} ({o['for']})"
                                       for u, o in summary["operators"].items()))

    def operator_password_file(self, account: str) -> Path:
        return self.secrets / "operators" / f"{account}.password"

    # --- 4. devices ----------------------------------------------------------------------

    def prepare_keys_and_data(self) -> None:
        """What needs no registry: the upstream's signing key, each device's key and data."""
        with ThreadPoolExecutor(len(DEVICES) + 1) as pool:  # each step is a subprocess
            keys = pool.submit(self.run, "registry", [str(BIN / "hpc-train"), "keygen",
                                                      "--out", str(self.out / "keys")])
            list(pool.map(self.prepare_device, [*DEVICES, NEW_DEVICE, DET_DEVICE],
                          [*DEVICES.values(), NEW_CAMERA, DET_CAMERA],
                          [0] * len(DEVICES) + [1, 1]))
            keys.result()

    def prepare_device(self, dev: str, camera: str, seed: int = 0) -> None:
        """What needs no registry: the device's key and its camera's data (``seed``: which
        unit of that kind of camera; the detector's device: images other than upstream's)."""
        model = model_of(dev)
        home = self.out / "devices" / dev
        state, data = home / "state", home / "data"
        state.mkdir(parents=True)
        data.mkdir()
        # The device's own key, named after it (the signer of its uploads), trusted only for
        # its own versions of this model.
        self.run(dev, [str(BIN / "hpc-train"), "keygen", "--out", str(state), "--name", dev,
                       "--scope", f"{model}@*+{dev}.*"])
        if model == DET_MODEL:  # 64 images as COCO, seen through its camera
            self.run(dev, [sys.executable, str(REPO / "scripts/make_detection_data.py"),
                           "--out", str(data / "camera"), "--images", "64", "--seed", str(seed),
                           "--camera", camera, *DET_SET, "--format", "coco"])
            return
        self.run(dev, [sys.executable, str(REPO / "scripts/make_device_data.py"),
                       "--distortion", camera, "--seed", str(seed),
                       "--out", str(data / "camera.npz")])

    def provision(self, dev: str, camera: str, group: str = GROUP) -> Path:
        model = model_of(dev)
        home = self.out / "devices" / dev
        state, data = home / "state", home / "data"
        trusted = state / "trusted_keys"
        trusted.mkdir()
        shutil.copy(self.out / "keys/upstream.pub.pem", trusted)
        for f in (f"{dev}.pub.pem", f"{dev}.scope"):
            shutil.copy(state / f, trusted / f)
            shutil.copy(state / f, self.out / "registry-trusted" / f)
        with self.registry_lock:  # one principals file for all devices
            self.add_principal(dev, "device", home / "registry.token")
        self.run(dev, [str(BIN / "agentctl"), "pull", f"{model}@1", "--registry",
                       self.registry_url, "--state-dir", str(state), "--no-progress"])
        # data_root: the data sets a command may name ("data": "camera.npz"); commands
        # carry no paths, keys or registries (agent.yaml is the device's only trust source).
        cfg = {"device_id": dev, "groups": [group], "state_dir": str(state),
               "data_root": str(data), "profile": "sim", "sensors": "sim", "telemetry_s": 2,
               "socket_group": None,
               # The operator's objective for the application: fine-tuning yields to it.
               "latency_slo_ms": slo_of(dev),
               "mqtt": {"host": "127.0.0.1", "port": self.broker_port, "username": dev,
                        "password_file": str(self.secrets / "devices" / f"{dev}.password")},
               "registry": {"url": self.registry_url,
                            "signing_key": str(state / f"{dev}.key.pem"),
                            "token_file": str(home / "registry.token")}}
        (home / "agent.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.run(dev, [str(BIN / "edge-agent"), "validate", str(home / "agent.yaml")])
        self.say(dev, f"provisioned: {model}@1 pulled and verified, camera = {camera}")
        return home

    def start_agents(self) -> None:
        devices = [*DEVICES, NEW_DEVICE, DET_DEVICE]
        with ThreadPoolExecutor(len(devices)) as pool:  # each step is a subprocess
            homes = dict(zip(devices, pool.map(
                self.provision, devices, [*DEVICES.values(), NEW_CAMERA, DET_CAMERA],
                [GROUP] * len(DEVICES) + [NEW_GROUP, DET_GROUP]), strict=True))
        for dev, home in homes.items():
            # One rollout's args ("data": "camera.npz") fit every device: each resolves the
            # name under its own data_root.
            self.start(dev, [str(BIN / "edge-agent"), "--config", str(home / "agent.yaml")],
                       home / "agent.log", cwd=home)

    # --- 5. application ------------------------------------------------------------------

    def start_runtimes(self) -> None:
        """The application's runtime beside each daemon, as an operator starts it: the
        committed model, following commits, its latency stats in STATE/runtime/ (what the
        daemon's telemetry and the fine-tune's governor read)."""
        for dev in APP_DEVICES:
            home = self.out / "devices" / dev
            port = self.app_ports[dev] = free_port()
            self.start(f"app-{dev}", [str(BIN / "agentctl"), "serve", "--state-dir",
                                      str(home / "state"), "--model", model_of(dev),
                                      "--port", str(port),
                                      "--slo-ms", str(slo_of(dev)), "--threads", "1",
                                      "--log-format", "text"],
                       home / "app.log", cwd=home)

    def start_apps(self) -> None:
        """Each device's application sends requests from now until after the rollout."""
        for dev, port in self.app_ports.items():
            app = AppLoad(dev, port, self.say, model_of(dev),
                          DET_APP_RATE_HZ if dev == DET_DEVICE else APP_RATE_HZ)
            if not app.wait_ready(60):
                log = self.out / "devices" / dev / "app.log"
                raise DemoError(f"{dev}: agentctl serve not ready after 60 s:\n"
                                f"{log.read_text()[-2000:]}")
            served = app.start()
            self.apps[dev] = app
            self.say(dev, f"app: agentctl serve {served} on 127.0.0.1:{port}; sending "
                          f"{app.rate_hz:g} requests/s, p99 SLO {slo_of(dev):g} ms")

    def finish_apps(self) -> None:
        """Let each application be answered by the version its device committed (the swap
        lands between two requests), then stop sending."""
        want = {dev: o.model.version for dev, o in self._outcomes().items()
                if o.outcome == "committed" and o.model}
        deadline = time.monotonic() + APP_SWAP_WAIT_S
        while (any(v not in self.apps[d].versions for d, v in want.items() if d in self.apps)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        for app in self.apps.values():
            app.stop()

    # --- live view -----------------------------------------------------------------------

    def follow(self) -> None:
        topics = Topics()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"demo-view-{os.getpid()}",
                        protocol=mqtt.MQTTv5)
        c.username_pw_set("fleet-watch",
                          self.operator_password_file("fleet-watch").read_text().strip())
        c.suppress_exceptions = True
        online = threading.Event()

        def on_message(_c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
            try:
                kind, dev, _ = topics.parse(msg.topic)
                if kind == "status":
                    st = Status.from_payload(msg.payload)
                    model = f"{st.model.name}@{st.model.version}" if st.model else "no model"
                    self.say(dev, f"{st.state} (connection {st.conn_seq}), {model}")
                    self.stage[dev] = st.state
                    if all(self.stage.get(d) == "online" for d in APP_DEVICES):
                        online.set()
                elif kind == "res":
                    self._result(dev, Result.from_payload(msg.payload))
                elif kind == "telemetry":
                    self._telemetry(dev, Telemetry.from_payload(msg.payload))
                elif kind == "evt":
                    evt = json.loads(msg.payload)
                    self.say(dev, f"event {evt.get('kind')}: {_brief(evt.get('data', {}))}")
            except Exception as e:  # the view must never die on one odd message
                self.say("view", f"unreadable message on {msg.topic}: {e}")

        c.on_message = on_message
        c.on_connect = lambda cl, *_: cl.subscribe(
            [(topics.all_status(), 1), (topics.all_results(), 1), (topics.all_events(), 1),
             (topics.all_telemetry(), 0)])
        c.connect("127.0.0.1", self.operator_port)
        c.loop_start()
        self.mq = c
        if not online.wait(60):
            raise DemoError(f"devices not online after 60 s: {self.stage}; see "
                            f"{self.out}/devices/*/agent.log")

    def _result(self, dev: str, res: Result) -> None:
        if res.status == "IN_PROGRESS" and res.progress:
            p = res.progress
            if p.stage != self.stage.get(dev):
                self.stage[dev] = p.stage
                self.say(dev, f"stage {p.stage}{_detail(p.detail)}")
            return
        self.say(dev, f"{res.status} {res.id}"
                      + (f": {res.error.code} {res.error.message}" if res.error else ""))
        if res.result is not None and res.status in ("SUCCEEDED", "FAILED"):
            self.results[dev] = res.result

    def _telemetry(self, dev: str, t: Telemetry) -> None:
        if t.job is None or t.job.stage != "finetune" or t.job.step is None:
            return
        gov = t.governor
        temp = max(t.temps_c.values()) if t.temps_c else None
        seen = (t.job.step, gov.state, gov.duty, gov.reason) if gov else (t.job.step,)
        if self.last_step.get(dev) == seen:
            return
        self.last_step[dev] = seen
        line = [f"finetune step {t.job.step}/{t.job.total or '?'}"]
        if gov is not None and gov.duty is not None:
            # reason: the limit that set the duty (thermal, power, latency: the application's)
            line.append(f"governor {gov.state} duty {gov.duty:.2f}"
                        + (f" ({gov.reason})" if gov.reason else ""))
        if temp is not None:
            line.append(f"{temp:.1f} °C")
        app = (t.serving or {}).get(model_of(dev))  # what its serving runtimes report
        if app is not None:
            line.append(f"app p99 {_ms(app.p99_ms)} / SLO {_ms(app.slo_ms)}, "
                        f"{app.requests} requests" + (f", {app.failed} FAILED" if app.failed
                                                      else ""))
        self.say(dev, "  ".join(line))

    # --- 6. fleet ------------------------------------------------------------------------

    def rollout(self) -> int:
        args = self.out / "finetune-args.json"
        args.write_text(json.dumps(self.job_args, indent=2))
        self.say("fleet", f"rollout of a finetune job to group '{GROUP}': wave 1 = 1 canary, "
                          "wave 2 = the rest")
        cmd = [*self.fleetctl(), "rollout", "create", "--name", "demo", "--group", GROUP,
               "--job", "finetune", "--args", f"@{args}", "--waves", "1,100%", "--bake-s", "3",
               "--abort-failure-rate", "0.5", "--min-completed", "1",
               "--max-metric-drop", "0.05", "--timeout-s", "600"]
        return self._stream(cmd)

    def rollout_detector(self) -> int:
        """The detector's group gets its own rollout once the classifiers' ended: pull ->
        fine-tune at 160 px under the budget -> INT8 with NMS in the graph, gated by mAP@0.5
        -> stage -> health by mAP on the device's held-out images -> commit -> upload."""
        args = self.out / "detector-args.json"
        args.write_text(json.dumps(DET_ARGS, indent=2))
        self.say("fleet", f"rollout of a finetune job to group '{DET_GROUP}' ({DET_MODEL}, "
                          f"{DET_ARGS['finetune']['steps']} steps at 160 px, INT8 gated by "
                          "mAP@0.5, health by mAP)")
        return self._stream([*self.fleetctl(), "rollout", "create", "--name", "cameras",
                             "--group", DET_GROUP, "--job", "finetune", "--args", f"@{args}",
                             "--waves", "100%", "--min-completed", "1", "--timeout-s", "600"])

    def fleetctl(self) -> list[str]:
        """fleetctl as the operator's controller account, on the demo's fleet db."""
        return [str(BIN / "fleetctl"), "--log-format", "text",
                "--port", str(self.operator_port), "--username", "fleet-controller",
                "--password-file", str(self.operator_password_file("fleet-controller")),
                "--db", str(self.out / "fleet.db"), "--report-dir", str(self.out / "reports")]

    def _stream(self, cmd: list[str]) -> int:
        with subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=self.out) as p:
            self.procs.append(("fleet", p))  # type: ignore[arg-type]
            assert p.stdout is not None
            for line in p.stdout:
                if line.strip():
                    self.say("fleet", line.rstrip())
        return p.returncode

    def learn(self) -> int:
        """One round of fleet learning on the rollout's uploads: aggregate, evaluate on the
        devices, publish behind the gate as release 2. Not deployed to these three: each
        one's own fine-tune beats the aggregate on its own camera, and its deploy health
        check would roll the aggregate back; the release is the base the next round
        fine-tunes from, and what a new device starts from (:meth:`deploy_new`)."""
        self.say("fleet", f"learning round: the {len(DEVICES)} uploads of rollout 'demo' -> "
                          "hpc-train aggregate (fedavg) -> evaluate on every device -> "
                          f"publish {MODEL}@2 if no device loses over {LEARN_MAX_DROP_PTS:g} "
                          "points")
        self.finetunes = self._outcomes()  # the evaluate jobs' results replace them
        code = self._stream([
            *self.fleetctl(), "learn", "start", LEARN, "--group", GROUP, "--model", MODEL,
            "--base", "1", "--rounds", "1", "--release-versions", "numbered",
            "--data", "camera.npz",
            # Upstream writes the registry's folder; the server serves what it holds.
            "--registry", str(self.out / "registry"),
            "--trusted-keys", str(self.out / "registry-trusted"),
            "--sign-key", str(self.out / "keys/upstream.key.pem"),
            "--first-updates", "demo", "--min-updates", str(len(DEVICES)),
            "--min-devices", str(len(DEVICES)), "--max-device-drop", str(LEARN_MAX_DROP_PTS),
            # each device also scores the aggregate with its own head (FedPer): personalized
            "--eval-personal", "head", "--timeout-s", "600"])
        status = [*self.fleetctl(), "learn", "status", LEARN]
        self.learn_status = self.run("fleet", status)
        (self.learn_round,) = json.loads(self.run("fleet", [*status, "--json"]))["history"]
        r1 = self.learn_round
        if code == 0 and r1["outcome"] != "published":
            self.say("fleet", f"learning round: {r1['outcome'] or r1['phase']}: {r1['reason']}")
            code = 1
        return code

    def deploy_new(self) -> int:
        """The round's release deployed to the new device: pulled and verified, staged,
        health-checked on its own camera's held-out data against the upstream model it runs
        (rolled back if worse), committed."""
        release = self.learn_round["release"]
        self.say("fleet", f"deploy {MODEL}@{release} to {NEW_DEVICE} (group '{NEW_GROUP}', "
                          f"camera {NEW_CAMERA}, running {MODEL}@1)")
        args = {"model": MODEL, "version": release, "data": "camera.npz"}
        code = self._stream([
            *self.fleetctl(), "rollout", "create", "--name", f"release-{release}", "--devices",
            NEW_DEVICE, "--job", "deploy", "--args", json.dumps(args), "--waves", "100%",
            "--min-completed", "1", "--timeout-s", "300"])
        o = self._outcomes().get(NEW_DEVICE)
        if code == 0 and (o is None or o.outcome != "committed"):
            self.say("fleet", f"{NEW_DEVICE}: {MODEL}@{release} not committed: "
                              f"{o.reason if o else 'no result'}")
            code = 1
        return code

    def deploy_summary(self) -> None:
        o = self._outcomes()[NEW_DEVICE]
        before, after = o.metrics_before.get("eval/acc"), o.metrics_after.get("eval/acc")
        print(f"deployed: {MODEL}@{self.learn_round['release']} on {NEW_DEVICE} (a new "
              f"device, camera {NEW_CAMERA}): {_pct(before)} -> {_pct(after)} on its own "
              f"held-out data, against the {MODEL}@1 it had")

    def learn_summary(self) -> None:
        """Per device and on the union of their held-out data: the base, the aggregate, and
        the device's own fine-tune (what its rollout committed)."""
        r1, outcomes = self.learn_round, self.finetunes
        evals = {e["device"]: e for e in r1["evaluations"]}
        release = r1["release"]
        print(f"fleet learning ({MODEL}@{release} = fedavg of {r1['updates']['combined']} "
              "device updates), accuracy on each device's held-out data:")
        rows = [("device", "camera", "base 1", f"aggregate {release}",
                 f"{release} + own head", "own fine-tune")]
        for dev, camera in DEVICES.items():
            e, o = evals.get(dev), outcomes.get(dev)
            own = o.metrics_after.get("eval/acc") if o else None
            rows.append((dev, camera, f"{e['base_accuracy']:.1%}" if e else "-",
                         f"{e['candidate_accuracy']:.1%}" if e else "-",
                         _pct(e.get("personalized_accuracy")) if e else "-",
                         f"{own:.1%}" if own is not None else "-"))
        ev = r1["evaluation"]
        rows.append(("union", "", f"{ev['base_accuracy']:.1%}", f"{ev['candidate_accuracy']:.1%}",
                     "", ""))
        _table(rows)
        own_better = all(
            o is not None and dev in evals
            and o.metrics_after.get("eval/acc", 0.0) > evals[dev]["candidate_accuracy"]
            for dev, o in ((d, outcomes.get(d)) for d in DEVICES))
        print(f"fleet learning: {MODEL}@1 -> {MODEL}@{release} on the union of the devices' "
              f"data {ev['base_accuracy']:.1%} -> {ev['candidate_accuracy']:.1%} "
              f"({ev['mean_gain_pts']:+.1f} pts); published, signed by upstream, with its "
              f"lineage; {', '.join(DEVICES)} keep their own fine-tunes"
              + (" (better on their own cameras than the aggregate)" if own_better else "")
              + f", {NEW_DEVICE} starts from it")

    def _outcomes(self) -> dict[str, JobOutcome]:
        return {dev: JobOutcome.model_validate(r) for dev, r in self.results.items()}

    def summary(self) -> bool:
        """Print the mission's figures; False when an application lost a request or was never
        answered by the version its device committed."""
        fallbacks: list[tuple[str, str]] = []
        outcomes = self._outcomes()
        rows = [("device", "camera", "acc before -> after", "export", "INT8 drop", "p50 ms",
                 "peak MB / budget", "max °C / target", "committed", "uploaded")]
        for dev, camera in DEVICES.items():
            o = outcomes.get(dev)
            if o is None:
                rows.append((dev, camera, "no result", *[""] * 7))
                continue
            extra = o.model_extra or {}
            exp = extra.get("export") or {}
            if exp.get("fallback"):
                fallbacks.append((dev, exp["fallback"]))
            mem = extra.get("memory") or {}
            gov = extra.get("governor") or {}
            before, after = o.metrics_before.get("eval/acc"), o.metrics_after.get("eval/acc")
            rows.append((
                dev, camera,
                f"{before:.1%} -> {after:.1%}" if before is not None and after is not None
                else "-",
                str(exp.get("winner") or "-")
                + (f" [{exp['int8_recipe']}]" if exp.get("int8_recipe") else ""),
                f"{exp['int8_drop_pts']:+.2f} pts" if exp.get("int8_drop_pts") is not None
                else "-",
                f"{exp['p50_ms_b1']:.2f}" if exp.get("p50_ms_b1") is not None else "-",
                _pair(mem.get("peak_tree_mb") or mem.get("peak_mb"), mem.get("budget_mb")),
                _pair(gov.get("max_temp_c"), gov.get("target_c")),
                f"{o.model.name}@{o.model.version}" if o.outcome == "committed" and o.model
                else f"{o.outcome} ({o.reason})",
                o.uploaded.version if o.uploaded else "-",
            ))
        print()
        _table(rows)
        # The INT8 drop column is the winner's; a plain-INT8 miss is shown, never hidden.
        for dev, note in fallbacks:
            print(f"{dev}: export fallback: {note}")
        print()
        self._detector_summary(outcomes.get(DET_DEVICE))
        print()
        app_ok = self._app_summary(outcomes)
        print()
        pngs = sorted(self.out.glob("devices/*/state/**/report.png")) + sorted(
            (self.out / "reports").glob("*.png"))
        for png in pngs:
            print(f"report: {png}")
        return app_ok

    def _detector_summary(self, o: JobOutcome | None) -> None:
        """The detector's row: its mAP on the device's held-out images before (upstream's
        model, torch) and after (the exported file it committed, in ONNX Runtime), what the
        export made of it, and what the fine-tune cost."""
        print(f"detector ({DET_MODEL}, group '{DET_GROUP}'), on the device's held-out images:")
        rows = [("device", "camera", "mAP@0.5 before -> after", "mAP@0.5:0.95", "export",
                 "INT8 mAP@0.5 drop", "float layers", "p50 ms", "peak MB / budget",
                 "committed")]
        if o is None:
            rows.append((DET_DEVICE, DET_CAMERA, "no result", *[""] * 7))
            _table(rows)
            return
        extra = o.model_extra or {}
        health, exp = extra.get("health") or {}, extra.get("export") or {}
        mem = extra.get("memory") or {}

        def map50(role: str) -> float | None:
            return ((health.get(role) or {}).get("metrics") or {}).get("map50")

        before, after = o.metrics_before.get("eval/map"), o.metrics_after.get("eval/map")
        rows.append((
            DET_DEVICE, DET_CAMERA, f"{_num(map50('active'))} -> {_num(map50('staged'))}",
            f"{_num(before)} -> {_num(after)}",
            str(exp.get("winner") or "-")
            + (f" [{exp['int8_recipe']}]" if exp.get("int8_recipe") else ""),
            f"{exp['map50_drop_pts']:+.2f} pts" if exp.get("map50_drop_pts") is not None
            else "-",
            ", ".join(exp.get("excluded_layers") or []) or "none",
            f"{exp['p50_ms_b1']:.2f}" if exp.get("p50_ms_b1") is not None else "-",
            _pair(mem.get("peak_tree_mb") or mem.get("peak_mb"), mem.get("budget_mb")),
            f"{o.model.name}@{o.model.version}" if o.outcome == "committed" and o.model
            else f"{o.outcome} ({o.reason})"))
        _table(rows)
        if exp.get("fallback"):
            print(f"{DET_DEVICE}: export fallback: {exp['fallback']}")

    def _app_summary(self, outcomes: dict[str, JobOutcome]) -> bool:
        print(f"application (agentctl serve, batch 1; each classifier {APP_RATE_HZ:g} "
              f"requests/s, p99 SLO {APP_SLO_MS:g} ms; the detector {DET_APP_RATE_HZ:g}/s, "
              f"SLO {DET_APP_SLO_MS:g} ms):")
        rows = [("device", "requests", "failed", "answered by version (requests)",
                 "app p99 in fine-tune (worst)", "fine-tune yielded s")]
        problems, swaps = [], 0
        for dev in APP_DEVICES:
            app, o = self.apps.get(dev), outcomes.get(dev)
            if app is None:
                rows.append((dev, "-", "-", "not started", "-", "-"))
                problems.append(f"{dev}: its application never ran")
                continue
            gov = _pacing(o)
            rows.append((dev, str(app.sent), str(app.failed),
                         ", ".join(f"{v} ({n})" for v, n in app.versions.items()) or "-",
                         _ms(gov.get("worst_app_p99_ms")),
                         f"{gov['yielded_s']:.1f}" if gov.get("yielded_s") is not None
                         else "-"))
            if app.failed:
                why = "; ".join(f"{n} x {e}" for e, n in app.errors.most_common(3))
                problems.append(f"{dev}: {app.failed} of {app.sent} requests failed ({why})")
            if o is not None and o.outcome == "committed" and o.model is not None:
                if o.model.version in app.versions:
                    swaps += 1
                else:
                    problems.append(f"{dev}: never answered by {o.model.version}, the version "
                                    "it committed")
        _table(rows)
        sent = sum(a.sent for a in self.apps.values())
        if problems:
            for p in problems:
                print(f"application FAILED: {p}")
            print("the application lost requests or missed its model's swap: the demo exits 1")
            return False
        print(f"application: {sent} requests, 0 failed; {swaps} swaps to a committed version, "
              "each between two requests")
        return True


def _pacing(o: JobOutcome | None) -> dict[str, Any]:
    """The fine-tune's pacing summary (its report.json, beside the report.png the result
    names): what the application's latency cost it."""
    png = (o.model_extra or {}).get("report_png") if o is not None else None
    try:
        return dict(json.loads(Path(png).with_suffix(".json").read_text())["summary"])
    except (TypeError, OSError, ValueError, KeyError):
        return {}


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms" if v < 10 else f"{v:.0f} ms"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _pair(a: Any, b: Any) -> str:
    if a is None:
        return "-"
    return f"{a:.0f} / {b:.0f}" if b is not None else f"{a:.0f}"


def _detail(d: dict[str, Any] | None) -> str:
    return f": {_brief(d)}" if d else ""


def _brief(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in list(d.items())[:6] if not isinstance(v, dict | list))


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise DemoError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so both end in the same clean-up."""

    def raise_interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@private_umask()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "runs/demo",
                    help="everything the demo makes (default: runs/demo; emptied first)")
    ap.add_argument("--epochs", type=int, default=3, help="device fine-tune epochs")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    job_args = {
        "model": MODEL, "data": "camera.npz",
        "finetune": {"epochs": args.epochs, "trainable": "all", "lr": 0.002, "budget_mb": 600,
                     "sim_time_scale": 300},
        "steps": {"upload": True},
    }
    view = View()
    mission = Mission(out, view, job_args)
    code = 1
    with _interruptible():
        try:
            run = mission.train_upstream()
            export = mission.start_export(run)
            detector = mission.start_detector_training()
            mission.start_broker()
            mission.prepare_keys_and_data()
            mission.publish(run, mission.exported(run, export))
            det_run = mission.detector_trained(detector)
            mission.publish_detector(det_run,
                                     mission.exported(det_run, mission.start_export(
                                         det_run, DET_ARGS["export"]["gates"]["latency_iters"])))
            mission.start_agents()
            mission.start_runtimes()
            mission.follow()
            mission.start_apps()
            code = mission.rollout()
            if code == 0:
                code = mission.rollout_detector()
            time.sleep(1.0)  # the last results' echo on the live view
            mission.finish_apps()
            if not mission.summary() and code == 0:
                code = 1
            if code == 0:
                code = mission.learn()
                print()
                print(mission.learn_status)
                if code == 0:  # published: every device scored it
                    code = mission.deploy_new()
                    print()
                    mission.learn_summary()
                    if code == 0:
                        mission.deploy_summary()
                print(f"report: {out / 'reports' / f'learn-{LEARN}.png'}")
        except KeyboardInterrupt:
            view("demo", "interrupted: stopping every process it started")
            code = 130
        except DemoError as e:
            view("demo", f"failed: {e}")
            code = 1
        finally:
            mission.stop_all()
    view("demo", f"done (exit {code}); everything is under {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
