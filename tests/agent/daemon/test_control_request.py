"""The control socket's client side against a daemon that answers before it reads."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from agent.daemon.control import request


def test_a_refusal_sent_before_the_request_is_read_still_reaches_the_client(
    tmp_path: Path,
) -> None:
    # The daemon refuses a stranger from SO_PEERCRED alone: it writes the refusal and closes
    # without reading. A request larger than the socket's buffer makes the client's write
    # meet that closed end every time (EPIPE): the refusal must still be what it reads.
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def refuse() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(json.dumps({"error": "uid 65534 may not use this daemon"}).encode()
                         + b"\n")

    t = threading.Thread(target=refuse)
    t.start()
    try:
        answers = list(request(path, {"op": "status", "pad": "x" * 4_000_000}, 10))
    finally:
        t.join(10)
        server.close()
    assert answers == [{"error": "uid 65534 may not use this daemon"}]
