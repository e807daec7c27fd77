"""The control socket: ``agentctl`` talks to the running daemon with the cloud unreachable.

``control_socket`` (default ``<state_dir>/agent.sock``), mode 0660, group ``socket_group``. Who
connects is checked per connection with ``SO_PEERCRED``: root, the service user or a member of
``socket_group``; anyone else is told so and closed. At most ``limits.control_connections``
clients at once, and each must send its request and read each answer within
``limits.control_timeout_s``. One JSON object per line each way. Requests (``op``):

- ``{"op": "command", "command": {<contract Command>}, "follow": true}``: the same command
  schema as MQTT; answered with ``{"result": <Result>}`` lines (with ``follow``, until the
  command's terminal status), then ``{"end": true}``.
- ``{"op": "jobs", "limit": 20}``: ``{"jobs": [...]}`` newest first.
- ``{"op": "logs", "job_id": ID, "lines": 50}``: ``{"lines": [...]}`` of the worker's log.
- ``{"op": "status"}``: ``{"status": {...}}`` (the status command's result, without MQTT).
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import pwd
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.daemon.announce import Announcer
from agent.daemon.commands import CommandHandler
from agent.jobs.store import JobRecord, JobStore
from contract import COMMAND_ID_RE, TERMINAL_STATUSES, Result

log = logging.getLogger("agent.daemon.control")

MAX_REQUEST_BYTES = 256 * 1024
UCRED = "iII"
"""struct ucred (SO_PEERCRED): pid_t, uid_t, gid_t."""
MAX_LIST, MAX_LOG_LINES = 1000, 5000
"""Largest answers to ``jobs`` and ``logs``."""


def job_summary(rec: JobRecord) -> dict[str, Any]:
    return {"id": rec.id, "type": rec.type, "state": rec.state.value, "attempt": rec.attempt,
            "created_at": rec.created_at, "started_at": rec.started_at,
            "finished_at": rec.finished_at, "source": rec.source, "progress": rec.progress,
            "error": rec.error, "result": rec.result}


class ControlServer:
    def __init__(
        self, path: Path, handler: CommandHandler, announcer: Announcer, store: JobStore,
        *, status: Callable[[], dict[str, Any]], log_dir: Path, group: str | None,
        max_connections: int = 8, timeout_s: float = 10.0,
    ) -> None:
        self.path = path
        self.handler = handler
        self.ann = announcer
        self.store = store
        self._status = status
        self.log_dir = log_dir
        self.group = group
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # A folder of its own (e.g. /run/edge-agent) is one the admin group may enter.
        self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a stale socket from a killed daemon
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bind under a restrictive umask so the socket never exists with wider permissions.
        old = os.umask(0o117)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o660)
        if self.group:
            try:
                os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
            except (KeyError, PermissionError) as e:
                log.info("control socket keeps its group (%s: %s)", self.group, e)
        sock.listen(16)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self._sock is not None:
            self._sock.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.exception("control socket accept failed")
                return
            conn.settimeout(self.timeout_s)
            who = self._refused(conn)
            if who is None and not self._slots.acquire(blocking=False):
                who = (f"{self.max_connections} clients are connected already "
                       "(limits.control_connections): try again")
            if who is not None:
                with conn, contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"error": who}).encode() + b"\n")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="control-client",
                             daemon=True).start()

    def _refused(self, conn: socket.socket) -> str | None:
        """Why this peer may not talk to the daemon (SO_PEERCRED), or None."""
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize(UCRED))
            pid, uid, gid = struct.unpack(UCRED, creds)
        except OSError as e:
            return f"cannot tell who is connecting: {e}"
        if uid in (0, os.geteuid()) or self._in_admin_group(uid, gid):
            return None
        log.warning("control socket: refused uid %d (pid %d): not root, the service user or "
                    "in group %s", uid, pid, self.group)
        return (f"uid {uid} may not use this daemon: only root, the service user or members "
                f"of {self.group or '(no admin group configured)'}")

    def _in_admin_group(self, uid: int, gid: int) -> bool:
        if not self.group:
            return False
        try:
            g = grp.getgrnam(self.group)
        except KeyError:
            return False
        if gid == g.gr_gid:
            return True
        try:
            return pwd.getpwuid(uid).pw_name in g.gr_mem
        except KeyError:
            return False

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        finally:
            self._slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                f = conn.makefile("rwb")
                line = f.readline(MAX_REQUEST_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_REQUEST_BYTES:
                    _send(f, {"error": f"request over {MAX_REQUEST_BYTES} bytes"})
                    return
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                except ValueError as e:
                    _send(f, {"error": f"not a JSON request: {e}"})
                    return
                self._dispatch(req, f)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (Ctrl-C on --follow): nothing to answer
            except TimeoutError:
                log.info("control client silent or not reading for %.0fs: closed",
                         self.timeout_s)
            except Exception as e:
                log.exception("control request failed")
                with contextlib.suppress(OSError):
                    _send(f, {"error": f"{type(e).__name__}: {e}"})

    def _dispatch(self, req: dict[str, Any], f: Any) -> None:
        op = req.get("op")
        if op == "status":
            _send(f, {"status": self._status()})
        elif op == "jobs":
            limit = min(int(req.get("limit", 20)), MAX_LIST)
            _send(f, {"jobs": [job_summary(r) for r in self.store.list(limit=limit)]})
        elif op == "logs":
            _send(f, {"lines": self._logs(str(req.get("job_id", "")),
                                          min(int(req.get("lines", 50)), MAX_LOG_LINES))})
        elif op == "command":
            self._command(req, f)
        else:
            _send(f, {"error": f"unknown op {op!r}: use command, jobs, logs or status"})

    def _logs(self, job_id: str, lines: int) -> list[str]:
        return read_log(self.log_dir, job_id, lines)

    def _command(self, req: dict[str, Any], f: Any) -> None:
        cmd = req.get("command")
        if not isinstance(cmd, dict):
            _send(f, {"error": "op=command needs a 'command' object (the MQTT command schema)"})
            return
        follow = bool(req.get("follow"))
        cid = cmd.get("id")
        q: queue.Queue[Result] = queue.Queue()

        def listener(r: Result) -> None:
            if r.id == cid:
                q.put(r)

        self.ann.listen(listener)
        try:
            first = self.handler.handle(json.dumps(cmd).encode(), str(cmd.get("type", "")),
                                        source="socket")
            for r in first:
                _send(f, {"result": json.loads(r.to_payload())})
            done = any(r.status in TERMINAL_STATUSES or (
                r.status == "DUPLICATE" and (r.stored_status in TERMINAL_STATUSES or not follow)
            ) for r in first)
            seen = {r.seq for r in first}
            while follow and not done and not self._stop.is_set():
                try:
                    r = q.get(timeout=1.0)
                except queue.Empty:
                    continue
                if r.seq in seen:
                    continue
                seen.add(r.seq)
                _send(f, {"result": json.loads(r.to_payload())})
                done = r.status in TERMINAL_STATUSES
            if not first:
                _send(f, {"error": "the command was not answered (see the daemon log)"})
        finally:
            self.ann.unlisten(listener)
        _send(f, {"end": True})


def read_log(log_dir: Path, job_id: str, lines: int) -> list[str]:
    """The last ``lines`` lines of a job's worker log (``<state_dir>/logs/<id>.log``)."""
    if not COMMAND_ID_RE.fullmatch(job_id):
        return [f"no job id {job_id!r}"]
    try:
        text = (log_dir / f"{job_id}.log").read_bytes()[-(lines * 400):].decode(
            errors="replace")
    except OSError:
        return [f"no log for job {job_id!r} (it has not started)"]
    return text.splitlines()[-lines:]


def request(
    path: Path, req: dict[str, Any], timeout_s: float | None = 30.0
) -> Iterator[dict[str, Any]]:
    """The client side: send one request, yield the answer lines until the last one (an
    ``end``, an ``error``, or the single answer of a non-command op). OSError when no daemon
    listens at ``path``; ``timeout_s`` bounds each wait for a line (None: follow forever)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        # A refused client is answered before the daemon reads (who we are decides): a write
        # after that finds it gone, and the refusal waits below.
        with contextlib.suppress(BrokenPipeError):
            s.sendall(json.dumps(req).encode() + b"\n")
        f = s.makefile("rb")
        for line in f:
            obj = json.loads(line)
            yield obj
            if obj.get("end") or "error" in obj or req.get("op") != "command":
                return


def _send(f: Any, obj: dict[str, Any]) -> None:
    f.write(json.dumps(obj).encode() + b"\n")
    f.flush()
