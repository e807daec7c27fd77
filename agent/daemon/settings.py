"""What the daemon derives from its config before it starts: the MQTT link's settings, the
job worker's environment (with this device's own registry token), and the state dir's modes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.daemon.config import AgentConfig
from agent.mqtt.link import LinkSettings
from agent.storage.trust import check_secret_file


def private_dir(path: Path) -> None:
    """``path`` exists and, when it is this user's, is 0700 with its databases 0600 (a state
    dir first made by ``agentctl pull`` under a 022 umask, or by an older agent, is
    tightened)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)
    for name in ("jobs.db", "agent.db"):
        f = path / name
        if f.exists() and f.stat().st_uid == os.geteuid():
            f.chmod(0o600)


def worker_env(cfg: AgentConfig) -> dict[str, str]:
    """The job worker's environment: the daemon's, the working directory never on sys.path
    (PYTHONSAFEPATH, Python 3.11+; the worker also runs in the state dir), and this device's
    own registry token bound to its configured registry (``registry.credentials``: sent to
    that origin only) in place of any token the daemon inherited."""
    from registry.credentials import REGISTRY_ENV, TOKEN_ENV, read_token_file

    env = dict(os.environ, PYTHONSAFEPATH="1")
    if cfg.registry.token_file is not None:
        env.pop(TOKEN_ENV, None)
        env.pop(REGISTRY_ENV, None)
        if cfg.registry.url:
            env[REGISTRY_ENV] = cfg.registry.url
            env[TOKEN_ENV] = read_token_file(cfg.registry.token_file)
    return env


def link_settings(cfg: AgentConfig) -> LinkSettings:
    """The MQTT link's settings: client id = device id; the password read from its file, which
    must be unreadable to others (checked here, at start)."""
    m = cfg.mqtt
    password = None
    if m.password_file is not None:
        check_secret_file(m.password_file, "mqtt.password_file")
        password = m.password_file.read_text().strip()
    username = m.username or (cfg.device_id if password is not None else None)
    return LinkSettings(
        client_id=cfg.device_id, host=m.host, port=m.port, keepalive_s=m.keepalive_s,
        session_expiry_s=m.session_expiry_s, username=username, password=password,
        ca=m.tls.ca if m.tls else None, cert=m.tls.cert if m.tls else None,
        key=m.tls.key if m.tls else None, tls=m.tls is not None,
        reconnect_min_s=m.reconnect_min_s, reconnect_max_s=m.reconnect_max_s,
    )
