"""systemd's notify protocol in a few lines: datagrams to ``$NOTIFY_SOCKET`` (man sd_notify).

``READY=1`` once the job store is recovered, ``STATUS=...`` lines, ``WATCHDOG=1`` from the
main loop every half ``$WATCHDOG_USEC`` (so a hung loop stops the pings and systemd restarts
the service), ``STOPPING=1`` on the way out. Without ``$NOTIFY_SOCKET`` every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("agent.daemon.sdnotify")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        # A leading '@' names the abstract namespace (a NUL byte on the wire).
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        self._sock: socket.socket | None = None
        if self._addr:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for; a child that inherited the
        # environment must not ping on the daemon's behalf.
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval_s: float | None = (
            int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        )

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self._addr)
            return True
        except OSError as e:  # systemd gone or socket full: never fatal for the daemon
            log.warning("sd_notify %s failed: %s", lines, e)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
