"""A throwaway PostgreSQL cluster on a free loopback port (the Optuna studies' and the fleet
controller's tests), and a fresh database in it per test."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """Not installed, or it would not start here: the caller skips with this reason."""


@dataclass
class PostgresServer:
    port: int
    createdb: list[str]
    _names: Iterator[int]

    @property
    def base_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}"

    def new_database(self, prefix: str = "t") -> str:
        """A fresh empty database; its URL."""
        name = f"{prefix}{next(self._names)}"
        subprocess.run([*self.createdb, name], check=True, capture_output=True, timeout=60)
        return f"{self.base_url}/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a cluster (trust auth on loopback, fsync off), stop and remove it afterwards."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb")]
    if not found or found[-1] is None:
        raise PostgresUnavailable("PostgreSQL is not installed (apt-get install postgresql)")
    bindir = Path(found[-1]).parent
    as_user: list[str] = []
    if os.geteuid() == 0:
        # initdb refuses to run as root: run the server as the postgres system user.
        if shutil.which("runuser") is None:
            raise PostgresUnavailable("running as root without runuser: cannot start PostgreSQL")
        as_user = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="pg-"))
    if as_user:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", _free_port()
    ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run(
            [*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
             "--no-sync"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        opts = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200")
        start = subprocess.run(
            [*ctl, "-o", opts, "-l", str(root / "server.log"), "-w", "-t", "60", "start"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        if start.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise PostgresUnavailable(
                f"PostgreSQL did not start: {start.stderr.strip()} {log[-500:]}")
        try:
            createdb = [*as_user, str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port),
                        "-U", "postgres"]
            yield PostgresServer(port, createdb, itertools.count(1))
        finally:
            subprocess.run([*ctl, "-m", "immediate", "-w", "stop"], capture_output=True,
                           timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
