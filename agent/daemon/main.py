"""``edge-agent``: the on-device daemon. ``edge-agent --config /etc/edge-agent/agent.yaml``.

Threads: the main loop (watchdog pings, telemetry, STATUS=), paho's network loop (commands
in, acks), the job runner (one worker process at a time) and the control socket. Start-up
order matters: the job store and the outbox are recovered (owed results re-queued) before
``READY=1``; then the control socket, MQTT and the runner start. SIGTERM: ``STOPPING=1``, the
running job checkpoints (its worker exits 75 and the job stays IN_PROGRESS), the retained
status goes offline, exit 0 well inside systemd's 30 s.

Torch is never imported here: jobs run in ``python -m agent.jobs.worker``.

Trust comes from the config only (``agent.yaml``): at start the secrets it names must be
unreadable to others and the trusted-keys folder writable by nobody but root or the service
user, or the daemon exits 2 naming the file. The state dir is made 0700 and what the daemon
and its workers create there 0600/0700, whatever umask it was started with.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.daemon.announce import Announcer, job_status, reply_of
from agent.daemon.commands import CommandHandler
from agent.daemon.config import DEFAULT_CONFIG, AgentConfig, ConfigError, load_agent_config
from agent.daemon.control import ControlServer
from agent.daemon.device import (
    Sensors,
    active_model,
    agent_version,
    boot_id,
    governor_of,
    models_fingerprint,
    set_power_mode,
)
from agent.daemon.metrics import DaemonMetrics
from agent.daemon.runner import JobRunner
from agent.daemon.sdnotify import Notifier
from agent.daemon.serving import serving_summary
from agent.daemon.settings import link_settings, private_dir, worker_env
from agent.jobs.store import JobState, JobStore
from agent.mqtt.link import Inbound, MqttLink
from agent.mqtt.outbox import Outbox
from contract import (
    COMMAND_ID_RE,
    TELEMETRY_EXPIRY_S,
    TERMINAL_STATUSES,
    JobProgress,
    Status,
    Telemetry,
    utc_now,
)
from registry.atomic import private_umask, remove_stale_temps
from registry.errors import KeyFileError

log = logging.getLogger("agent.daemon")


class Daemon:
    def __init__(
        self, cfg: AgentConfig, *, notifier: Notifier | None = None,
        worker_argv: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.topics = cfg.topics
        self.device = cfg.device_id
        private_dir(cfg.state_dir)
        self.notifier = notifier or Notifier()
        self.store = JobStore(cfg.state_dir)
        self.outbox = Outbox(cfg.state_dir)
        self.boot_id = boot_id()
        self.version = agent_version()
        self.conn_seq = 0
        self.link = MqttLink(
            link_settings(cfg), self.outbox, before_connect=self._before_connect,
            on_connected=self._on_connected, on_inbound=self._on_inbound,
        )
        self.ann = Announcer(self.outbox, self.topics, self.device, self.link.flush)
        self.runner = JobRunner(self.store, self.ann, cfg.state_dir, cfg.limits,
                                crashes=self._count_crash, worker_argv=worker_argv,
                                worker_env=worker_env(cfg), prune=self.prune)
        self.handler = CommandHandler(
            self.store, self.ann, status=self.status, cancel=self.runner.cancel,
            set_power_mode=set_power_mode, wake_runner=self.runner.wake,
            settings=cfg.job_settings(), limits=cfg.limits,
        )
        self.control = ControlServer(
            cfg.socket_path, self.handler, self.ann, self.store, status=self.status,
            log_dir=self.runner.log_dir, group=cfg.socket_group,
            max_connections=cfg.limits.control_connections,
            timeout_s=cfg.limits.control_timeout_s,
        )
        self.sensors = Sensors(cfg.sensors, state_dir=cfg.state_dir)
        self.stop_event = threading.Event()
        self.telemetry_seq = 0
        self.models_seen: tuple[tuple[str, str, int], ...] = ()
        """The models' fingerprint in the last retained status published."""
        self.loop_hook: Any = None
        """Called once per main-loop turn (tests make it hang to prove the watchdog stops)."""
        self.metrics = DaemonMetrics.of(cfg.metrics, self.device)

    # -- MQTT callbacks -----------------------------------------------------------------

    def _status_msg(self, state: str) -> bytes:
        return Status(
            state=state, device=self.device, conn_seq=self.conn_seq,  # type: ignore[arg-type]
            boot_id=self.boot_id, agent_version=self.version,
            model=active_model(self.cfg.state_dir), groups=self.cfg.groups, ts=utc_now(),
        ).to_payload()

    def _before_connect(self) -> tuple[str, bytes]:
        with self.outbox.tx() as tx:
            self.conn_seq = tx.next_seq("conn")
        return self.topics.status(self.device), self._status_msg("offline")

    def _on_connected(self, session_present: bool) -> None:
        subs = [self.topics.device_commands(self.device)]
        subs += [self.topics.group_commands(g) for g in self.cfg.groups]
        # Resubscribing when the session survived is harmless and covers changed groups.
        self.link.subscribe(subs)
        self._publish_status()
        self.notifier.status(self._status_line())

    def _publish_status(self) -> None:
        """The retained ``online`` status, with the model active now."""
        self.models_seen = models_fingerprint(self.cfg.state_dir)
        self.link.publish_now(self.topics.status(self.device), self._status_msg("online"),
                              qos=1, retain=True)

    def _republish_on_model_change(self) -> None:
        """A commit, rollback or pull changed the active model: say so in the retained status
        at once, so ``fleetctl devices`` never shows the version before it."""
        if self.link.connected and models_fingerprint(self.cfg.state_dir) != self.models_seen:
            self._publish_status()

    def _on_inbound(self, msg: Inbound) -> None:
        try:
            kind, target, sub = self.topics.parse(msg.topic)
        except ValueError:
            log.warning("message on a foreign topic %s ignored", msg.topic)
            return
        if kind not in ("cmd", "group_cmd") or sub is None:
            return
        wrong = None
        if kind == "cmd" and target != self.device:
            wrong = f"addressed to device {target!r}; this is {self.device!r}"
        elif kind == "group_cmd" and target not in self.cfg.groups:
            wrong = f"addressed to group {target!r}; this device is in {self.cfg.groups}"
        bad_reply = self._bad_reply(msg)
        # A response topic the device will not publish to is dropped: the refusal goes to the
        # device's own result topic only.
        reply = None if bad_reply else reply_of(msg.response_topic, msg.correlation_data)
        self.handler.handle(msg.payload, sub, source="mqtt", reply=reply, wrong_target=wrong,
                            bad_envelope=bad_reply)

    def _bad_reply(self, msg: Inbound) -> str | None:
        """Why the v5 ResponseTopic / CorrelationData cannot be honoured (bounded: each one
        is stored with every result of the command), or None."""
        lim = self.cfg.limits
        topic, corr = msg.response_topic, msg.correlation_data
        if topic is not None:
            size = len(topic.encode())
            if size > lim.max_response_topic_bytes:
                return (f"response topic is {size} bytes; the limit is "
                        f"{lim.max_response_topic_bytes} (limits.max_response_topic_bytes)")
            if not topic or any(c in topic for c in "+#\x00"):
                return "response topic must be a topic name: not empty, no + # or NUL"
        if corr is not None and len(corr) > lim.max_correlation_bytes:
            return (f"correlation data is {len(corr)} bytes; the limit is "
                    f"{lim.max_correlation_bytes} (limits.max_correlation_bytes)")
        return None

    # -- state ----------------------------------------------------------------------------

    def _count_crash(self, job_id: str) -> int:
        with self.outbox.tx() as tx:
            return tx.next_seq(f"crash:{job_id}") + 1

    def status(self) -> dict[str, Any]:
        model = active_model(self.cfg.state_dir)
        queued = self.store.list(limit=1000, states=[JobState.QUEUED])
        return {
            "device": self.device, "connected": self.link.connected, "conn_seq": self.conn_seq,
            "boot_id": self.boot_id, "agent_version": self.version, "groups": self.cfg.groups,
            "model": model.model_dump(exclude_none=True) if model else None,
            "job": self.runner.progress(), "queued": [r.id for r in reversed(queued)],
            "outbox": self.outbox.count(),
        }

    def _status_line(self) -> str:
        job = self.runner.progress()
        link = f"connected (conn_seq {self.conn_seq})" if self.link.connected else "offline"
        return f"MQTT {link}; " + (f"job {job['id']} {job.get('stage')}" if job else "idle")

    def prune(self) -> int:
        """Forget finished jobs and command records past ``limits.keep_*`` (never a job that
        has not ended): their rows, job folders, logs, announce ledger and crash counters.
        Runs on the job runner's thread, between jobs."""
        lim = self.cfg.limits
        older = time.time() - lim.keep_history_s
        ids = self.store.prune(keep=lim.keep_finished_jobs, older_than=older)
        with self.outbox.tx() as tx:
            self.ann.ledger.prune(tx, older_than=older, keep_commands=lim.keep_command_records,
                                  job_ids=ids)
            tx.drop_counters([f"crash:{j}" for j in ids])
        for jid in ids:
            # A record stored before ids were checked may be named ".." (its "folder" would be
            # the state dir itself): only a valid id names a file to delete.
            if COMMAND_ID_RE.fullmatch(jid):
                shutil.rmtree(self.cfg.state_dir / "jobs" / jid, ignore_errors=True)
                (self.runner.log_dir / f"{jid}.log").unlink(missing_ok=True)
        if ids:
            log.info("pruned %d finished job(s) from the history", len(ids))
        return len(ids)

    def sweep_temps(self) -> None:
        """Temp files of writers killed mid-write (the daemon, a worker, a job's child) in
        the state dir, the job folders and the models' records; slots clean their own."""
        sd = self.cfg.state_dir
        gone = remove_stale_temps(sd) + remove_stale_temps(sd / "jobs", recursive=True)
        for model in (sd / "models").glob("*/"):
            gone += remove_stale_temps(model)
        if gone:
            log.info("removed %d temporary file(s) of killed writers", len(gone))

    def recover(self) -> int:
        """Re-queue what the device owes from before a crash: a job's ACCEPTED that never
        went out, and terminal results the worker persisted while the daemon was down."""
        owed = 0
        for rec in self.store.list(limit=self.cfg.limits.job_history):
            done = self.ann.ledger.announced(rec.id)
            status = job_status(rec)
            if (status in TERMINAL_STATUSES and not (done & TERMINAL_STATUSES)) or (
                "ACCEPTED" not in done and status != "REJECTED"
            ):
                self.ann.announce_job(rec)
                owed += 1
        return owed

    # -- main loop ------------------------------------------------------------------------

    def reading(self) -> Telemetry:
        """The sensors, the running job and its governor, the serving runtimes: now."""
        reading = self.sensors.read()
        progress = self.runner.progress()
        job = None
        if progress:
            try:
                job = JobProgress.model_validate(progress)
            except Exception:
                job = JobProgress(id=progress["id"], stage=str(progress.get("stage", "?")))
        return Telemetry(ts=utc_now(), seq=self.telemetry_seq, governor=governor_of(progress),
                         job=job, serving=serving_summary(self.cfg.state_dir), **reading)

    def telemetry(self) -> None:
        msg = self.reading()
        self.telemetry_seq += 1
        self.link.publish_now(self.topics.telemetry(self.device), msg.to_payload(), qos=0,
                              props={"expiry_s": TELEMETRY_EXPIRY_S})

    def run(self) -> int:
        self.sweep_temps()
        owed = self.recover()
        self.control.start()
        self.link.start()
        self.runner.start()
        if self.metrics is not None:
            self.metrics.start(cfg=self.cfg.metrics)
        self.notifier.ready(f"job store recovered ({owed} results re-queued); connecting")
        log.info("edge-agent %s up as %s (state %s)", self.version, self.device, self.cfg.state_dir)
        wd = self.notifier.watchdog_interval_s
        now = time.monotonic()
        # A schedule that does not run is never due (a stale deadline made each wait 10 ms).
        next_wd, next_status, next_ckpt = now if wd is not None else math.inf, now, now + 2.0
        next_tel = now + 1.0 if self.cfg.telemetry_s > 0 else math.inf
        next_metrics = now + 1.0 if self.metrics is not None else math.inf
        while not self.stop_event.is_set():
            if self.loop_hook is not None:
                self.loop_hook()
            now = time.monotonic()
            if wd is not None and now >= next_wd:
                self.notifier.watchdog()
                next_wd = now + wd
            if self.cfg.telemetry_s > 0 and now >= next_tel:
                try:
                    self.telemetry()
                except Exception:
                    log.exception("telemetry failed")
                next_tel = now + self.cfg.telemetry_s
            if self.metrics is not None:
                next_metrics = self.metrics.tick(now, self.reading, link=self.link,
                                                 outbox=self.outbox, store=self.store)
            try:
                self._republish_on_model_change()
            except Exception:  # the next turn tries again
                log.exception("republishing the status failed")
            if now >= next_status:
                self.notifier.status(self._status_line())
                next_status = now + 5.0
            if now >= next_ckpt:
                try:
                    self.outbox.checkpoint()
                except Exception as e:  # busy or full disk: the next turn tries again
                    log.warning("outbox checkpoint: %s", e)
                next_ckpt = now + 2.0
            wake = min(next_wd, next_tel, next_status, now + 1.0, next_metrics)
            self.stop_event.wait(max(0.01, wake - time.monotonic()))
        return self.shutdown()

    def shutdown(self) -> int:
        t0 = time.monotonic()
        self.notifier.stopping("stopping: checkpointing the running job")
        self.runner.stop()
        self.control.stop()
        if self.metrics is not None:
            self.metrics.close()
        self.link.stop(final=(self.topics.status(self.device), self._status_msg("offline")))
        self.sensors.close()
        self.outbox.close()
        log.info("edge-agent stopped in %.1fs", time.monotonic() - t0)
        return 0


# -- command line ---------------------------------------------------------------------------

EPILOG = """\
This config is the device's only source of trust and of where to talk: trusted keys, signing
key, registry and upload target, registry token, broker, data root and every path. Commands
(MQTT or the control socket) carry a model, a version, job knobs and names resolved under the
device's own folders (data: cam0 -> data_root/cam0); anything else is REJECTED naming the
field. Secrets open to group or others, or a trusted-keys folder others could write, stop the
start with exit 2 naming the file.

examples:
  edge-agent --config /etc/edge-agent/agent.yaml
  edge-agent validate /etc/edge-agent/agent.yaml
  EDGE_AGENT_MQTT__HOST=broker.lan edge-agent --config agent.yaml --set telemetry_s=5

exit codes: 0 stopped cleanly, 2 invalid config or arguments, or an unsafe secret or
trusted-keys folder
"""


def _config_path(arg: Path | None) -> Path | None:
    if arg is not None:
        return arg
    env = os.environ.get("EDGE_AGENT_CONFIG")
    if env:
        return Path(env)
    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def build_validate_parser() -> argparse.ArgumentParser:
    """``edge-agent validate``'s parser (dispatched before :func:`build_parser`'s)."""
    p = argparse.ArgumentParser(prog="edge-agent validate",
                                description="Check an agent config (and EDGE_AGENT_* overrides).")
    p.add_argument("config", type=Path)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Commands :func:`main` dispatches before its own parser, by name (for the docs)."""
    return {"validate": build_validate_parser()}


def validate(argv: list[str]) -> int:
    a = build_validate_parser().parse_args(argv)
    try:
        cfg = load_agent_config(a.config, overrides=a.overrides)
        if cfg.mqtt.password_file is not None and not cfg.mqtt.password_file.is_file():
            raise ConfigError(str(a.config), [
                f"  mqtt.password_file: {cfg.mqtt.password_file} does not exist"])
        if cfg.mqtt.tls is not None:
            missing = [f"  mqtt.tls.{k}: {v} does not exist" for k, v in
                       (("ca", cfg.mqtt.tls.ca), ("cert", cfg.mqtt.tls.cert),
                        ("key", cfg.mqtt.tls.key)) if v is not None and not Path(v).is_file()]
            if missing:
                raise ConfigError(str(a.config), missing)
        problems = cfg.check_files()
        if problems:
            raise ConfigError(str(a.config), problems)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    import yaml

    print(f"# {a.config}: valid")
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The daemon's parser; ``edge-agent validate`` has its own (:func:`subcommand_parsers`)."""
    p = argparse.ArgumentParser(prog="edge-agent", description=__doc__.splitlines()[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help=f"agent YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--log-format", choices=("auto", "text", "json"), default="auto")
    return p


# Whatever umask systemd, a shell or a test gave us: nothing the daemon or its workers create
# is for anyone else.
@private_umask()
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:
        return validate(argv[1:])
    a = build_parser().parse_args(argv)
    from hpc_core.logs import setup_logging

    setup_logging(a.log_format)
    os.environ["PYTHONSAFEPATH"] = "1"  # no child of ours imports from its working directory
    path = _config_path(a.config)
    try:
        cfg = load_agent_config(path, overrides=a.overrides)
        problems = cfg.check_files()
        if problems:
            raise ConfigError(str(path or "(environment)"), problems)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        daemon = Daemon(cfg)
    except KeyFileError as e:  # a secret that vanished or changed since the check above
        print(f"edge-agent: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
