"""The HTTP registry client's manners: a token goes only to its own registry, only where it is
needed, only over a safe transport; a body is read in pieces against the minimum rate."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from registry.credentials import (
    REGISTRY_ENV,
    TOKEN_ENV,
    RegistryCredential,
    credential_from_env,
    read_token_file,
)
from registry.errors import KeyFileError, SlowTransferError, StoreError
from registry.stores import HttpStore
from registry.transfer import TransferConfig, with_retries

TOKEN = "tok-" + "a" * 40


@dataclass
class Recorder:
    """A loopback server that logs each request's Authorization header and answers as told."""

    url: str = ""
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    challenge_reads: bool = False
    """GET/HEAD without a token get 401 + WWW-Authenticate: Bearer."""
    redirect_to: str | None = None
    """GETs (with a token, if challenged) are redirected (307) to this base URL."""


def _handler(rec: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, status: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k.replace("_", "-"), v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization")
            rec.seen.append((self.command, self.path, auth))
            if rec.challenge_reads and auth is None:
                self._reply(401, WWW_Authenticate='Bearer realm="test"')
            elif rec.redirect_to:
                self._reply(307, Location=rec.redirect_to + self.path)
            else:
                self._reply(200, b"{}")

        do_HEAD = do_GET

        def do_PUT(self) -> None:
            rec.seen.append(("PUT", self.path, self.headers.get("Authorization")))
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply(201)

    return Handler


@pytest.fixture
def recorders() -> Iterator[list[Recorder]]:
    """Two loopback servers: two origins (ports), one machine."""
    out, servers = [], []
    for _ in range(2):
        rec = Recorder()
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec))
        srv.daemon_threads = True
        rec.url = f"http://127.0.0.1:{srv.server_address[1]}"
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        out.append(rec)
        servers.append(srv)
    yield out
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def cfg() -> TransferConfig:
    return TransferConfig(connect_timeout_s=2, read_timeout_s=5, retries=0)


def test_the_token_goes_only_on_writes_and_only_to_its_registry(
    recorders: list[Recorder],
) -> None:
    ours, other = recorders
    cred = RegistryCredential(registry=ours.url + "/registry", token=TOKEN)
    store = HttpStore(ours.url, cfg(), cred)
    store.get("m/1/manifest.json", 100)
    assert store.exists("m/1/manifest.sig")
    store.put("m/1/manifest.sig", b"x")
    assert [a for _, _, a in ours.seen] == [None, None, f"Bearer {TOKEN}"]
    # Another registry (another port: another origin) never sees it, not even on a PUT.
    elsewhere = HttpStore(other.url, cfg(), cred)
    elsewhere.put("m/1/manifest.sig", b"x")
    elsewhere.get("m/1/manifest.json", 100)
    assert [a for _, _, a in other.seen] == [None, None]


def test_reads_carry_the_token_once_the_server_asks(recorders: list[Recorder]) -> None:
    ours, _ = recorders
    ours.challenge_reads = True
    store = HttpStore(ours.url, cfg(), RegistryCredential(registry=ours.url, token=TOKEN))
    assert store.get("m/1/manifest.json", 100) == b"{}"
    store.get("m/1/manifest.sig", 100)
    assert [a for _, _, a in ours.seen] == [None, f"Bearer {TOKEN}", f"Bearer {TOKEN}"]
    # Without a token for that registry a challenge is simply an error.
    with pytest.raises(StoreError, match="401"):
        HttpStore(ours.url, cfg(), None).get("m/1/manifest.json", 100)


def test_a_redirect_to_another_origin_loses_the_token(recorders: list[Recorder]) -> None:
    ours, other = recorders
    ours.challenge_reads = True
    ours.redirect_to = other.url
    store = HttpStore(ours.url, cfg(), RegistryCredential(registry=ours.url, token=TOKEN))
    assert store.get("m/1/manifest.json", 100) == b"{}"
    # Challenged, the read went again with the token, was redirected, and went on without it.
    assert [a for _, _, a in ours.seen] == [None, f"Bearer {TOKEN}"]
    assert [a for _, _, a in other.seen] == [None]


def test_plain_http_tokens_only_to_loopback() -> None:
    for url in ("https://registry.example.com", "http://127.0.0.1:8000", "http://[::1]:80",
                "http://localhost:9"):
        RegistryCredential(registry=url, token=TOKEN)
    for url in ("http://registry.example.com", "http://10.0.0.5:8000"):
        with pytest.raises(ValueError, match="only over https"):
            RegistryCredential(registry=url, token=TOKEN)
    cred = RegistryCredential(registry="https://registry.example.com/r", token=TOKEN)
    assert cred.header_for("https://registry.example.com:443/r/x") != {}
    # Same host over plain http, or another port, is another origin.
    assert cred.header_for("http://registry.example.com/r/x") == {}
    assert cred.header_for("https://registry.example.com:8443/r/x") == {}


def test_the_environment_token_is_bound_to_the_environment_registry() -> None:
    env = {TOKEN_ENV: TOKEN, REGISTRY_ENV: "https://models.example.com/registry"}
    cred = credential_from_env(env)
    assert cred is not None and cred.header_for("https://models.example.com/registry/x")
    assert not cred.header_for("https://attacker.example.com/registry/x")
    assert credential_from_env({TOKEN_ENV: TOKEN}) is None  # no registry named: sent nowhere
    assert credential_from_env({TOKEN_ENV: TOKEN, REGISTRY_ENV: "/srv/registry"}) is None
    with pytest.raises(KeyFileError, match="only over https"):
        credential_from_env({TOKEN_ENV: TOKEN, REGISTRY_ENV: "http://models.example.com"})
    with pytest.raises(KeyFileError, match="printable ASCII"):
        credential_from_env({TOKEN_ENV: "bad token", REGISTRY_ENV: "https://m.example.com"})


def test_a_token_file_open_to_others_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "registry.token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        read_token_file(f)
    f.chmod(0o600)
    assert read_token_file(f) == TOKEN


# --- slow retrieval inside one read -----------------------------------------------------------


@pytest.fixture
def dripping_server() -> Iterator[str]:
    """Answers every request at once with headers for a 4 KiB body, then drips the body at
    4 B/s: http.client's read(n) would wait for all n bytes."""
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # OSError: the client hung up, as it should
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n")
            while not stop.wait(0.25):
                conn.sendall(b"x")

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    sock.close()


@pytest.mark.parametrize("read", ["get", "open_range"])
def test_a_dripping_body_is_dropped_within_the_rate_window(dripping_server: str,
                                                           read: str) -> None:
    window = 1.0
    c = TransferConfig(connect_timeout_s=2, read_timeout_s=30, min_rate_bytes_per_s=1024,
                       min_rate_window_s=window, request_deadline_s=600, retries=0)
    store = HttpStore(dripping_server, c, None)

    def attempt(deadline: object) -> None:
        if read == "get":
            store.get("m/1/manifest.json", 1 << 20, deadline)  # type: ignore[arg-type]
            return
        reader = store.open_range("chunks/x", 0, deadline)  # type: ignore[arg-type]
        try:
            buf = memoryview(bytearray(256 << 10))
            while reader.readinto(buf):
                pass
        finally:
            reader.close()

    start = time.monotonic()
    with pytest.raises(Exception) as err:
        with_retries(attempt, c, "drip")
    held = time.monotonic() - start
    assert isinstance(err.value.__cause__, SlowTransferError), repr(err.value)
    # Dropped at the end of the first window, not at the 30 s read timeout or after 1000 s.
    assert window <= held < window + 0.5, held
    print(f"dripping body ({read}) dropped after {held:.2f} s (window {window:g} s)")


def test_the_token_never_reaches_a_log_line(recorders: list[Recorder]) -> None:
    ours, _ = recorders
    cred = RegistryCredential(registry=ours.url, token=TOKEN)
    assert TOKEN not in repr(cred) and TOKEN not in str(cred)
