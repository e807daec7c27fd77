"""A real mosquitto broker for tests: free loopback port, optional password file, ACL and TLS.

Stable API (the daemon's and the fleet's tests share it)::

    broker = start_mosquitto(workdir)                        # one test account, plain TCP
    broker = start_mosquitto(workdir, passwords={"dev-a": "pw"}, acl=ACL_DEVICE_PATTERN)
    broker = start_mosquitto(workdir, tls=make_pki(workdir, ["dev-a"]), require_certificate=True)
    broker.host, broker.port ; broker.stop() ; broker.start()   # restart on the same port

No broker here is anonymous (``allow_anonymous false`` everywhere, as ``fleetctl broker-config``
writes it): without ``passwords`` the broker gets one generated test account, which
:class:`Broker` carries (``username``, ``password``, ``password_file``) and
:class:`tests.support.mqtt.Peer` and the test configs use.

Recipe from the field notes: one ``listener PORT 127.0.0.1`` in a conf file (never ``-p`` with
``-c``), ``set_tcp_nodelay true``, a large ``max_queued_messages`` (the default 1000 drops
silently for a slow subscriber), ``user root`` when root (else mosquitto drops to the
``mosquitto`` user and cannot read 0600 auth files). Certificates are made on the fly with
``cryptography`` (see :mod:`tests.support.pki`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.pki import Pki

ACL_DEVICE_PATTERN = (
    "# each device reads and writes only its own subtree, and reads its groups' commands\n"
    "pattern readwrite fleet/v1/dev/%u/#\n"
    "pattern read fleet/v1/group/+/cmd/#\n"
)
"""Per-device isolation by username (or certificate CN with use_identity_as_username)."""
TEST_USER = "edgetrain-test"
"""The account of a broker started without ``passwords``."""
ACL_FLEET = ACL_DEVICE_PATTERN + "\nuser fleet\ntopic readwrite fleet/v1/#\n"
"""The device pattern plus a ``fleet`` user (the controller) that reads and writes it all."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def have_mosquitto() -> bool:
    return shutil.which("mosquitto") is not None


@dataclass
class Broker:
    """A mosquitto process on ``host:port``; ``stop()``/``start()`` keep the port and conf."""

    host: str
    port: int
    conf: Path
    workdir: Path
    tls: Pki | None = None
    log: Path | None = None
    username: str | None = None
    """The generated test account (None where the test gave its own passwords or certs)."""
    password: str | None = None
    password_file: Path | None = None
    """``password`` in a 0600 file, for configs that read it from one (agent, fleetctl)."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 10.0) -> Broker:
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["mosquitto", "-c", str(self.conf)], stdout=log, stderr=log,
            stdin=subprocess.DEVNULL,
        )
        if log is not subprocess.DEVNULL:
            log.close()
        return self.wait_for_listener(self.port, timeout_s)

    def wait_for_listener(self, port: int, timeout_s: float = 10.0) -> Broker:
        """Until this process accepts connections on ``port`` (one of its listeners: mosquitto
        opens them one after another, so the first being up says nothing of the others)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((self.host, port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    tail = self.log.read_text()[-2000:] if self.log and self.log.exists() else ""
                    raise RuntimeError(f"mosquitto did not start on {port}: {tail}") from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (mosquitto saves its persistence file, if enabled, on the way out)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)

    def agent_mqtt(self) -> dict[str, object]:
        """The ``mqtt`` section of an agent.yaml that logs in to this broker with its test
        account (host and port only where it has none: certificates or the test's own)."""
        cfg: dict[str, object] = {"host": self.host, "port": self.port}
        if self.username is not None:
            cfg |= {"username": self.username, "password_file": str(self.password_file)}
        return cfg

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def write_password_file(path: Path, passwords: dict[str, str]) -> Path:
    """A mosquitto password file (hashed with the real ``mosquitto_passwd``)."""
    path.unlink(missing_ok=True)
    for i, (user, pw) in enumerate(passwords.items()):
        args = ["mosquitto_passwd", "-b"] + (["-c"] if i == 0 else []) + [str(path), user, pw]
        subprocess.run(args, check=True, capture_output=True)
    path.chmod(0o600)
    return path


def start_mosquitto(
    workdir: Path,
    *,
    passwords: dict[str, str] | None = None,
    acl: str | None = None,
    tls: Pki | None = None,
    require_certificate: bool = False,
    use_identity_as_username: bool = False,
    persistence: bool = False,
    port: int | None = None,
    extra_conf: str = "",
) -> Broker:
    """Write a conf under ``workdir`` and start mosquitto on a free loopback port.

    ``passwords``: user -> password; without it (and without certificate identities) one
    generated account, :data:`TEST_USER`, that may use every topic. ``acl``: ACL file text
    (e.g. :data:`ACL_DEVICE_PATTERN`). ``tls``: serve TLS with the Pki's server certificate;
    ``require_certificate`` asks clients for one signed by its CA, and
    ``use_identity_as_username`` makes the certificate's CN the username the ACL sees.
    ``persistence``: keep sessions and queued messages across ``stop()``/``start()``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    lines = [f"listener {port} 127.0.0.1", "set_tcp_nodelay true",
             "max_queued_messages 100000", "max_inflight_messages 0"]
    if os.geteuid() == 0:
        lines.append("user root")
    lines.append("allow_anonymous false")
    account: tuple[str, str, Path] | None = None
    if passwords is None and not use_identity_as_username:
        pw = secrets.token_hex(12)
        pw_file = workdir / f"{TEST_USER}.password"
        pw_file.write_text(pw + "\n")
        pw_file.chmod(0o600)
        account = (TEST_USER, pw, pw_file)
        passwords = {TEST_USER: pw}
    if passwords is not None:
        lines.append(f"password_file {write_password_file(workdir / 'passwd', passwords)}")
    if acl is not None:
        acl_path = workdir / "acl"
        acl_path.write_text(acl)
        acl_path.chmod(0o600)
        lines.append(f"acl_file {acl_path}")
    if tls is not None:
        lines += [f"cafile {tls.ca_cert}", f"certfile {tls.server_cert}",
                  f"keyfile {tls.server_key}", "tls_version tlsv1.2"]
        if require_certificate:
            lines.append("require_certificate true")
        if use_identity_as_username:
            lines.append("use_identity_as_username true")
    if persistence:
        lines += ["persistence true", f"persistence_location {workdir}/",
                  "autosave_interval 1"]
    else:
        lines.append("persistence false")
    lines += ["log_type error", "log_type warning", "log_type notice", "log_dest stderr"]
    if extra_conf:
        lines.append(extra_conf)
    conf = workdir / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    broker = Broker("127.0.0.1", port, conf, workdir, tls=tls, log=workdir / "mosquitto.log")
    if account is not None:
        broker.username, broker.password, broker.password_file = account
    return broker.start()


def start_from_conf(conf: Path, port: int, workdir: Path, *, tls: Pki | None = None) -> Broker:
    """mosquitto on a conf that ``fleetctl broker-config`` wrote, plus only what a test run
    needs (``user root`` to read its 0600 files when root, a log in ``workdir``); ``port`` is
    one of its listeners, the one :meth:`Broker.start` waits for."""
    workdir.mkdir(parents=True, exist_ok=True)
    lines = [conf.read_text()]
    if os.geteuid() == 0:
        lines.append("user root")
    lines.append("log_type error\nlog_type warning\nlog_type notice\nlog_dest stderr")
    test_conf = workdir / f"{conf.parent.name}-test.conf"
    test_conf.write_text("\n".join(lines) + "\n")
    return Broker("127.0.0.1", port, test_conf, workdir, tls=tls,
                  log=workdir / f"{conf.parent.name}.log").start()
