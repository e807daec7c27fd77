"""The whole mission on one machine, as ``make demo`` runs it.

1. upstream: ``torchrun`` trains small_cnn on digits with 2 DDP processes (gloo, CPU);
2. registry: ``hpc-train keygen`` + ``publish`` a signed version, served over loopback HTTP
   by ``python -m registry.serve``; each device gets its own upload token
   (``registry.serve add-principal``) and may write only its own versions;
3. broker: a throwaway mosquitto provisioned by ``fleetctl broker-config`` from an inventory:
   one account per device (its client id), an ACL that keeps each device to its own topics and
   its groups' commands, and an account per operator tool on a listener of their own;
4. devices: three ``edge-agent`` daemons on the simulated board (``sim`` profile and
   sensors), each provisioned with ``agentctl pull`` and given its own camera's data (the
   documented distortions of digits, a different one per device);
5. fleet: ``fleetctl rollout create`` runs a ``finetune`` job in two waves (a canary, then
   the rest): pull -> fine-tune under the memory budget and the governor -> INT8 export with
   gates -> stage -> health -> commit -> upload of each device's signed delta.

Everything is driven through the command lines, MQTT and HTTP, as an operator would. The live
view below follows the devices over MQTT (the fleet's operator account). Every process it
starts is stopped on exit, also on Ctrl-C. Re-running starts from scratch in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import yaml

from contract import JobOutcome, Result, Status, Telemetry, Topics
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

    # --- 2. registry ---------------------------------------------------------------------

    def publish(self, run: Path) -> None:
        keys, reg = self.out / "keys", self.out / "registry"
        self.run("registry", [str(BIN / "hpc-train"), "keygen", "--out", str(keys)])
        self.run("registry", [str(BIN / "hpc-train"), "publish", str(run), "--registry",
                              str(reg), "--name", MODEL, "--version", "1",
                              "--sign-key", str(keys / "upstream.key.pem")])
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
        self.say("registry", f"published {MODEL}@1, signed by the upstream key; served at "
                             f"{self.registry_url} (uploads: each principal its own token)")

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
            {"devices": {dev: {"groups": [GROUP]} for dev in DEVICES}}))
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

    def provision(self, dev: str, camera: str) -> Path:
        home = self.out / "devices" / dev
        state, data = home / "state", home / "data"
        trusted = state / "trusted_keys"
        trusted.mkdir(parents=True)
        data.mkdir()
        shutil.copy(self.out / "keys/upstream.pub.pem", trusted)
        # The device's own key, named after it (the signer of its uploads), trusted only for
        # its own versions of this model.
        self.run(dev, [str(BIN / "hpc-train"), "keygen", "--out", str(state), "--name", dev,
                       "--scope", f"{MODEL}@*+{dev}.*"])
        for f in (f"{dev}.pub.pem", f"{dev}.scope"):
            shutil.copy(state / f, trusted / f)
            shutil.copy(state / f, self.out / "registry-trusted" / f)
        with self.registry_lock:  # one principals file for all devices
            self.add_principal(dev, "device", home / "registry.token")
        self.run(dev, [str(BIN / "agentctl"), "pull", f"{MODEL}@1", "--registry",
                       self.registry_url, "--state-dir", str(state), "--no-progress"])
        self.run(dev, [sys.executable, str(REPO / "scripts/make_device_data.py"),
                       "--distortion", camera, "--out", str(data / "camera.npz")])
        # data_root: the data sets a command may name ("data": "camera.npz"); commands
        # carry no paths, keys or registries (agent.yaml is the device's only trust source).
        cfg = {"device_id": dev, "groups": [GROUP], "state_dir": str(state),
               "data_root": str(data), "profile": "sim", "sensors": "sim", "telemetry_s": 2,
               "socket_group": None,
               "mqtt": {"host": "127.0.0.1", "port": self.broker_port, "username": dev,
                        "password_file": str(self.secrets / "devices" / f"{dev}.password")},
               "registry": {"url": self.registry_url,
                            "signing_key": str(state / f"{dev}.key.pem"),
                            "token_file": str(home / "registry.token")}}
        (home / "agent.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.run(dev, [str(BIN / "edge-agent"), "validate", str(home / "agent.yaml")])
        self.say(dev, f"provisioned: {MODEL}@1 pulled and verified, camera = {camera}")
        return home

    def start_agents(self) -> None:
        with ThreadPoolExecutor(len(DEVICES)) as pool:  # each step is a subprocess
            homes = dict(zip(DEVICES, pool.map(self.provision, DEVICES, DEVICES.values()),
                             strict=True))
        for dev, home in homes.items():
            # One rollout's args ("data": "camera.npz") fit every device: each resolves the
            # name under its own data_root.
            self.start(dev, [str(BIN / "edge-agent"), "--config", str(home / "agent.yaml")],
                       home / "agent.log", cwd=home)

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
                    if all(self.stage.get(d) == "online" for d in DEVICES):
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
        seen = (t.job.step, gov.state if gov else None)
        if self.last_step.get(dev) == seen:
            return
        self.last_step[dev] = seen
        self.say(dev, f"finetune step {t.job.step}/{t.job.total or '?'}"
                      + (f"  governor {gov.state} duty {gov.duty:.2f}" if gov and gov.duty
                         is not None else "")
                      + (f"  {temp:.1f} °C" if temp is not None else "")
                      + (f"  ({gov.reason})" if gov and gov.reason else ""))

    # --- 5. fleet ------------------------------------------------------------------------

    def rollout(self) -> int:
        args = self.out / "finetune-args.json"
        args.write_text(json.dumps(self.job_args, indent=2))
        self.say("fleet", f"rollout of a finetune job to group '{GROUP}': wave 1 = 1 canary, "
                          "wave 2 = the rest")
        cmd = [str(BIN / "fleetctl"), "--log-format", "text",
               "--port", str(self.operator_port), "--username", "fleet-controller",
               "--password-file", str(self.operator_password_file("fleet-controller")),
               "--db", str(self.out / "fleet.db"), "--report-dir", str(self.out / "reports"),
               "rollout", "create", "--name", "demo", "--group", GROUP, "--job", "finetune",
               "--args", f"@{args}", "--waves", "1,100%", "--bake-s", "3",
               "--abort-failure-rate", "0.5", "--min-completed", "1",
               "--max-metric-drop", "0.05", "--timeout-s", "600"]
        with subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=self.out) as p:
            self.procs.append(("fleet", p))  # type: ignore[arg-type]
            assert p.stdout is not None
            for line in p.stdout:
                if line.strip():
                    self.say("fleet", line.rstrip())
        return p.returncode

    def summary(self) -> None:
        fallbacks: list[tuple[str, str]] = []
        rows = [("device", "camera", "acc before -> after", "export", "INT8 drop", "p50 ms",
                 "peak MB / budget", "max °C / target", "committed", "uploaded")]
        for dev, camera in DEVICES.items():
            r = self.results.get(dev)
            if r is None:
                rows.append((dev, camera, "no result", *[""] * 7))
                continue
            o = JobOutcome.model_validate(r)
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
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        print()
        for i, r in enumerate(rows):
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
            if i == 0:
                print("  ".join("-" * w for w in widths))
        # The INT8 drop column is the winner's; a plain-INT8 miss is shown, never hidden.
        for dev, note in fallbacks:
            print(f"{dev}: export fallback: {note}")
        print()
        pngs = sorted(self.out.glob("devices/*/state/**/report.png")) + sorted(
            (self.out / "reports").glob("*.png"))
        for png in pngs:
            print(f"report: {png}")


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
            mission.publish(run)
            mission.start_broker()
            mission.start_agents()
            mission.follow()
            code = mission.rollout()
            time.sleep(1.0)  # the last results' echo on the live view
            mission.summary()
        except KeyboardInterrupt:
            view("demo", "interrupted: stopping every process it started")
            code = 130
        except DemoError as e:
            view("demo", f"failed: {e}")
        finally:
            mission.stop_all()
    view("demo", f"done (exit {code}); everything is under {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
