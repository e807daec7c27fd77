"""Attacks on the registry and its clients (issue 19, items 3, 4, 6 and 7), each against the real
``python -m registry.serve`` on loopback, provisioned with an upstream publisher and two
devices, each with its own token and key. Every test asserts the attack is refused AND that
nothing was lost: every object already there is byte-identical, a device still pulls and
installs upstream's version, upstream still publishes its next version and an honest device
still uploads."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import itertools
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.storage.update import update
from registry.credentials import REGISTRY_ENV, TOKEN_ENV
from registry.errors import FetchFailedError, KeyFileError, PublishError, RefError, StoreError
from registry.manifest import BaseRelease
from registry.names import chunk_key, manifest_key, sequence_key, signature_key
from registry.publish import publish_version, sign_version
from registry.refs import parse_ref
from registry.signing import load_trusted_keys
from registry.stores import open_store
from registry.transfer import TransferConfig
from registry.upload import upload
from tests.support.registry_serve import MODEL, ServedRegistry, fast, make_contents, serve_registry
from tests.support.registry_server import RegistryServer

_installs = itertools.count()
RELEASE_1 = BaseRelease(version="1", sequence=1)
"""Upstream's digits@1, as a device version names its lineage's start."""


@pytest.fixture(scope="module")
def contents(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return make_contents(tmp_path_factory.mktemp("checkpoints"), 5)


@pytest.fixture
def reg(tmp_path: Path, subprocess_env: dict[str, str],
        contents: list[Any]) -> Iterator[ServedRegistry]:
    """The registry with upstream's digits@1 published through it."""
    with serve_registry(tmp_path / "served", subprocess_env) as r:
        r.publish(contents[0], "1")
        yield r


def nothing_lost(reg: ServedRegistry, before: dict[str, bytes], contents: list[Any],
                 tmp_path: Path, upstream_next: str = "2") -> None:
    after = reg.snapshot()
    # Every object is as it was; the counter may only have moved on (honest commits move it).
    changed = [k for k in before if after.get(k) != before[k] and k != sequence_key(MODEL)]
    assert changed == [], "objects changed or lost"
    if sequence_key(MODEL) in before:
        was, now = (json.loads(x[sequence_key(MODEL)])["sequence"] for x in (before, after))
        assert now >= was
    state = tmp_path / f"device-{next(_installs)}"
    got = update(parse_ref(f"{MODEL}@1", reg.url), state_dir=state,
                 trusted=load_trusted_keys(reg.trusted), cfg=fast())
    assert got.switch.active.version == "1"  # type: ignore[union-attr]
    m = reg.publish(contents[2], upstream_next, parent="1").manifest
    assert m.signer.name == "upstream" and m.sequence > 1
    assert reg.upload(contents[3], "dev-b").manifest.signer.name == "dev-b"


def put(reg: ServedRegistry, key: str, body: bytes, who: str | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, str]:
    """A raw PUT as ``who`` (its own token), bypassing the client's own checks."""
    hdrs = dict(headers or {})
    if who is not None:
        hdrs["Authorization"] = f"Bearer {reg.who[who].token}"
    host, port = reg.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("PUT", "/" + key if not key.startswith("/") else key, body=body,
                     headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def raw(url: str, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are; return everything the server answers until it closes or
    goes quiet."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and out.startswith(b"HTTP/1.1 "):
                    break
        except TimeoutError:
            pass
        return out


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer.split()[1])


# --- 3: one fleet-wide token, sent to any URL -------------------------------------------------


@pytest.fixture
def attacker() -> Iterator[tuple[str, list[str | None]]]:
    """A registry an attacker runs (another origin, loopback): it logs every Authorization
    header and accepts every upload."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            self._answer(404)

        do_HEAD = do_GET

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer(201)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def test_a_token_goes_to_no_other_registry(
    reg: ServedRegistry, attacker: tuple[str, list[str | None]], contents: list[Any],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device's token is in its environment, for its registry; a command names another."""
    evil, seen = attacker
    monkeypatch.setenv(TOKEN_ENV, reg.who["dev-a"].token)
    monkeypatch.setenv(REGISTRY_ENV, reg.url)
    before = reg.snapshot()
    key = reg.who["dev-a"].key
    # An upload to the attacker's registry goes through (it accepts anything), tokenless.
    upload(contents[1], parent=reg.manifest("1"), target=evil, key=key, cfg=fast())
    with pytest.raises(RefError, match="no such version"):
        update(parse_ref(f"{MODEL}@1", evil), state_dir=tmp_path / "s",
               trusted=load_trusted_keys(reg.trusted), cfg=fast())
    assert seen and all(a is None for a in seen), seen
    # Plain http to a remote host never carries it either: refused before any request.
    monkeypatch.setenv(REGISTRY_ENV, "http://203.0.113.7:8000")
    with pytest.raises(KeyFileError, match="only over https"):
        open_store("http://203.0.113.7:8000", fast())
    # Nothing lost: the same environment, pointed at its own registry, uploads as dev-a.
    monkeypatch.setenv(REGISTRY_ENV, reg.url)
    m = upload(contents[1], parent=reg.manifest("1"), target=reg.url, key=key,
               cfg=fast()).manifest
    assert m.signer.name == "dev-a"
    nothing_lost(reg, before, contents, tmp_path)


def test_an_unknown_or_leaked_token_writes_nothing(
    reg: ServedRegistry, contents: list[Any], tmp_path: Path,
) -> None:
    before = reg.snapshot()
    data = b"a chunk an attacker wants stored"
    key = chunk_key(hashlib.sha256(data).hexdigest())
    principals = (tmp_path / "served/provision/principals.yaml").read_text()
    hashed = principals.split("token_sha256: ")[1].split()[0]
    for token in (None, "the-old-fleet-wide-token", hashed, reg.who["dev-a"].token + "x"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        status, body = put(reg, key, data, headers=headers)
        assert status == 401, (token, status, body)
    assert not (reg.root / key).exists()
    nothing_lost(reg, before, contents, tmp_path)


# --- 4: the server authorized nothing per object ----------------------------------------------


def test_nothing_stored_can_be_overwritten(
    reg: ServedRegistry, contents: list[Any], tmp_path: Path,
) -> None:
    before = reg.snapshot()
    m1 = reg.manifest("1")
    first = chunk_key(m1.chunks[0].sha256)
    # Chunks: the bytes must hash to the key, so an existing chunk can only be "written" as
    # itself; other bytes are refused whoever sends them.
    for who in ("dev-a", "upstream"):
        assert put(reg, first, b"poisoned bytes", who)[0] == 400
        assert put(reg, chunk_key("0" * 64), b"bytes that hash elsewhere", who)[0] == 400
    assert put(reg, first, before[first], "dev-a")[0] == 200  # itself: a no-op
    # A signed version: neither a device nor upstream itself may replace it.
    forged = m1.model_copy(update={"training": m1.training.model_copy(
        update={"metrics": {"eval/acc": 0.01}})}).to_bytes()
    for who in ("dev-a", "upstream"):
        sig = reg.who[who].key.sign_manifest(forged)
        status, body = put(reg, signature_key(MODEL, "1"), sig, who)
        assert status in (403, 409), body
        assert put(reg, manifest_key(MODEL, "1"), forged, who)[0] in (403, 409)
        counter = json.dumps({"sequence": 1_000_000, "version": "1"}).encode()
        assert put(reg, sequence_key(MODEL), counter, who)[0] == 409
    # Paths outside the registry's layout, or out of the folder.
    for path, want in [("/digits/1/evil.bin", 403), ("/notes/readme.txt", 403),
                       ("/.serve/pending/upstream/digits@2.sig", 403),
                       ("/digits/_sequence.json/x", 403), ("/../outside", 400),
                       ("/digits/%2e%2e/%2e%2e/outside", 400), ("/digits//1/manifest.json", 400),
                       ("/chunks/sha256/00/" + "0" * 64 + "/x", 403)]:
        status, body = put(reg, path, b"x" * 100, "dev-a")
        assert status == want, (path, status, body)
    assert not (tmp_path / "outside").exists() and not (reg.root.parent / "outside").exists()
    nothing_lost(reg, before, contents, tmp_path)


def test_a_device_cannot_take_an_upstream_version_or_another_devices(
    reg: ServedRegistry, contents: list[Any], tmp_path: Path,
) -> None:
    before = reg.snapshot()
    dev_a = reg.who["dev-a"].key
    # digits@3 signed with dev-a's key: its scope does not cover it, and it is not dev-a's.
    with pytest.raises(StoreError, match="403"):
        upload(contents[1], parent=reg.manifest("1"), target=reg.url, key=dev_a, version="3",
               cfg=fast(), credential=reg.credential("dev-a"))
    # Even a misprovisioned key the server trusts for everything (no scope file) writes only
    # dev-a's own versions: not upstream's, not dev-b's.
    (reg.trusted / "dev-a.scope").unlink()
    time.sleep(1.2)  # the server re-reads its keys once a second
    for version in ("3", "1+dev-b.20250101T000000Z", "1+dev-a.x+dev-b.y"):
        with pytest.raises(StoreError, match="403"):
            upload(contents[1], parent=reg.manifest("1"), target=reg.url, key=dev_a,
                   version=version, cfg=fast(), credential=reg.credential("dev-a"))
    # dev-b's own signature (say, copied off the wire) does not let dev-a commit it.
    signed = sign_version(name=MODEL, version="1+dev-b.z", sequence=2, model=contents[1].model,
                          tensors=contents[1].tensors, key=reg.who["dev-b"].key,
                          on_chunk=lambda ref, data: None, parent="1",
                          chunk_size=16 << 10, pack_below=4 << 10)
    status, body = put(reg, signature_key(MODEL, "1+dev-b.z"), signed.signature_bytes, "dev-a")
    assert status == 403 and "belongs to dev-b" in body
    assert not (reg.root / MODEL / "3").exists()
    # Upstream's own digits@3 goes through as before the attack.
    nothing_lost(reg, before, contents, tmp_path, upstream_next="3")


def test_a_device_cannot_push_sequences_out_of_upstreams_reach(
    reg: ServedRegistry, contents: list[Any], tmp_path: Path,
) -> None:
    """A device signing its version with sequence 2**53 would leave upstream no number."""
    before = reg.snapshot()
    store = reg.store("dev-a")
    for sequence in (1 << 53, 10):
        with pytest.raises(PublishError, match="the next for digits is 2"):
            publish_version(store, name=MODEL, version=f"1+dev-a.s{sequence}",
                            model=contents[1].model, tensors=contents[1].tensors,
                            key=reg.who["dev-a"].key, parent="1", parent_seq=sequence - 1,
                            base=RELEASE_1, chunk_size=16 << 10, pack_below=4 << 10)
    assert json.loads((reg.root / sequence_key(MODEL)).read_text())["sequence"] == 1
    nothing_lost(reg, before, contents, tmp_path)
    assert reg.manifest("2").sequence == 2


def test_racing_manifests_never_share_a_sequence(
    tmp_path: Path, subprocess_env: dict[str, str], contents: list[Any],
) -> None:
    """Eight devices sign sequence 2 and PUT their manifests at the same instant, with no
    client-side retry: exactly one is stored; the counter moved once."""
    devices = [f"dev-{i}" for i in range(8)]
    with serve_registry(tmp_path / "served", subprocess_env, [*devices, "dev-b"]) as reg:
        reg.publish(contents[0], "1")
        before = reg.snapshot()
        signed = {}
        for i, dev in enumerate(devices):
            store = reg.store(dev)

            def send(ref: Any, data: bytes, store: Any = store) -> None:
                if not store.exists(chunk_key(ref.sha256)):
                    store.put(chunk_key(ref.sha256), data)

            signed[dev] = sign_version(
                name=MODEL, version=f"1+{dev}.race", sequence=2, model=contents[1 + i % 4].model,
                tensors=contents[1 + i % 4].tensors, key=reg.who[dev].key, on_chunk=send,
                parent="1", base=RELEASE_1, chunk_size=16 << 10, pack_below=4 << 10)
            assert put(reg, signature_key(MODEL, f"1+{dev}.race"), signed[dev].signature_bytes,
                       dev)[0] == 201
        gate, statuses = threading.Barrier(len(devices)), {}

        def commit(dev: str) -> None:
            gate.wait()
            statuses[dev] = put(reg, manifest_key(MODEL, f"1+{dev}.race"),
                                signed[dev].manifest_bytes, dev)[0]

        threads = [threading.Thread(target=commit, args=(d,)) for d in devices]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(statuses.values()) == [201] + [409] * 7, statuses
        assert json.loads((reg.root / sequence_key(MODEL)).read_text())["sequence"] == 2
        nothing_lost(reg, before, contents, tmp_path, upstream_next="2b")


# --- 6: no bound on connections, time or bodies; malformed requests dropped ----------------


def test_half_open_connections_cannot_exhaust_the_server(
    tmp_path: Path, subprocess_env: dict[str, str], contents: list[Any],
) -> None:
    limits = ["--workers", "8", "--backlog", "8", "--header-timeout-s", "1",
              "--keepalive-s", "1"]
    with serve_registry(tmp_path / "served", subprocess_env, ["dev-a", "dev-b"],
                        *limits) as reg:
        reg.publish(contents[0], "1")
        before = reg.snapshot()
        host, port = reg.url.removeprefix("http://").split(":")
        held = []
        for _ in range(300):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"PUT /digits/9/manifest.json HTTP/1.1\r\nContent-Len")
            held.append(s)
        time.sleep(0.3)
        threads = reg.threads()
        assert threads <= 8 + 2, threads  # the workers and the accepting thread
        # Honest clients get through (503s are retried) while the half-open ones are cut.
        patient = fast().model_copy(update={"retries": 30, "backoff_max_s": 0.5})
        start = time.monotonic()
        got = update(parse_ref(f"{MODEL}@1", reg.url), state_dir=tmp_path / "s",
                     trusted=load_trusted_keys(reg.trusted), cfg=patient)
        assert got.switch.active.version == "1"  # type: ignore[union-attr]
        waited = time.monotonic() - start
        cut = sum(1 for s in held if _closed_by_peer(s))
        for s in held:
            s.close()
        assert cut == 300, cut
        print(f"300 half-open connections: {threads} server threads; an honest pull waited "
              f"{waited:.1f} s; all 300 closed by the server")
        nothing_lost(reg, before, contents, tmp_path)


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the server closed it (after a 503, or with nothing said)."""
    s.settimeout(10)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_dripping_requests_are_cut_at_their_deadlines(
    tmp_path: Path, subprocess_env: dict[str, str], contents: list[Any],
) -> None:
    limits = ["--header-timeout-s", "1", "--io-timeout-s", "1",
              "--min-upload-bytes-per-s", "10000000"]
    with serve_registry(tmp_path / "served", subprocess_env, ["dev-a", "dev-b"],
                        *limits) as reg:
        reg.publish(contents[0], "1")
        before = reg.snapshot()
        host, port = reg.url.removeprefix("http://").split(":")
        # Headers one byte at a time, each well inside any per-read timeout.
        request = b"GET /digits/1/manifest.json HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 50
        with socket.create_connection((host, int(port)), timeout=5) as s:
            start = time.monotonic()
            with contextlib.suppress(OSError):
                for byte in request:
                    s.sendall(bytes([byte]))
                    time.sleep(0.05)
            header_cut = time.monotonic() - start
        assert header_cut < 1.6, header_cut
        # A body one byte at a time: 408 once its deadline (1 s + length at the rate) passes.
        head = (f"PUT /{chunk_key('a' * 64)} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                f"Authorization: Bearer {reg.who['dev-a'].token}\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(head)
            start = time.monotonic()
            answer = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in answer and time.monotonic() - start < 5:
                    s.sendall(b"x")
                    if select.select([s], [], [], 0.05)[0]:
                        answer += s.recv(65536)
            body_cut = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert body_cut < 1.6, body_cut
        print(f"dripped headers cut after {header_cut:.2f} s, dripped body after "
              f"{body_cut:.2f} s (408)")
        assert not list((reg.root / ".serve/incoming").iterdir())
        nothing_lost(reg, before, contents, tmp_path)


def test_bodies_stream_to_disk_under_a_cap(
    tmp_path: Path, subprocess_env: dict[str, str], contents: list[Any],
) -> None:
    cap = 128 << 20
    with serve_registry(tmp_path / "served", subprocess_env, ["dev-a", "dev-b"],
                        "--max-chunk-bytes", str(cap)) as reg:
        reg.publish(contents[0], "1")
        before = reg.snapshot()
        token = reg.who["dev-a"].token
        # Over the cap: refused on its headers, before a byte of body is read.
        for key, length in [(chunk_key("b" * 64), cap + 1),
                            (manifest_key(MODEL, "1+dev-a.big"), (64 << 20) + 1),
                            (signature_key(MODEL, "1+dev-a.big"), 4097)]:
            answer = raw(reg.url, (f"PUT /{key} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}"
                                   f"\r\nAuthorization: Bearer {token}\r\n\r\n").encode())
            assert status_of(answer) == 413, (key, answer[:100])
        # Just under it: streamed to a file, hashed on the way, refused (wrong hash) without
        # the body ever being held in memory.
        rss_before = reg.peak_rss_mb()
        body = b"\0" * (cap - 1)
        status, _ = put(reg, chunk_key("c" * 64), body, "dev-a")
        assert status == 400
        grew = reg.peak_rss_mb() - rss_before
        assert grew < 32, grew
        print(f"a {len(body) >> 20} MiB upload raised the server's peak RSS by {grew:.1f} MiB")
        assert not list((reg.root / ".serve/incoming").iterdir())
        nothing_lost(reg, before, contents, tmp_path)


def test_malformed_requests_are_answered_400_and_others_keep_being_served(
    reg: ServedRegistry, contents: list[Any], tmp_path: Path,
) -> None:
    before = reg.snapshot()
    host, port = reg.url.removeprefix("http://").split(":")
    honest = http.client.HTTPConnection(host, int(port), timeout=5)  # one kept-alive client
    token = reg.who["dev-a"].token
    key = "/" + chunk_key("d" * 64)
    cases = [
        (b"PUT " + key.encode() + b" HTTP/1.1\r\nContent-Length: abc\r\nAuthorization: Bearer "
         + token.encode() + b"\r\n\r\n", 400),
        (b"PUT " + key.encode() + b" HTTP/1.1\r\nContent-Length: -1\r\nAuthorization: Bearer "
         + token.encode() + b"\r\n\r\n", 400),
        (b"PUT " + key.encode() + b" HTTP/1.1\r\nContent-Length: 4\r\nAuthorization: Bearer "
         b"\xff\xfe\xfd\r\n\r\nabcd", 401),
        (b"PUT " + key.encode() + b" HTTP/1.1\r\nTransfer-Encoding: chunked\r\nAuthorization: "
         b"Bearer " + token.encode() + b"\r\n\r\n0\r\n\r\n", 411),
        (b"GET /digits/%ff/manifest.json HTTP/1.1\r\n\r\n", 400),
        (b"GET /digits/1%00/manifest.json HTTP/1.1\r\n\r\n", 400),
        (b"GET http://elsewhere/digits/1/manifest.json HTTP/1.1\r\n\r\n", 400),
        (b"DELETE /digits/1/manifest.json HTTP/1.1\r\n\r\n", 501),
    ]
    # Each case carries a Host header, so it is refused for what it names: HTTP/1.1 without
    # one is a 400 of its own (RFC 9112 §3.2), below with the framing errors.
    cases = [(r.replace(b"\r\n", b"\r\nHost: x\r\n", 1), want) for r, want in cases] + [
        (b"GET /digits/1/manifest.json HTTP/1.1\r\n\r\n", 400),
        (b"PUT " + key.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
         b"Content-Length: 5\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\nabcd", 400),
        (b"PUT " + key.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
         b"Transfer-Encoding: chunked\r\nAuthorization: Bearer " + token.encode()
         + b"\r\n\r\n0\r\n\r\n", 400),
    ]
    for request, want in cases:
        assert status_of(raw(reg.url, request)) == want, request[:80]
        honest.request("GET", f"/{MODEL}/1/manifest.sig")
        resp = honest.getresponse()
        assert resp.status == 200 and resp.read() == before[f"{MODEL}/1/manifest.sig"]
    honest.close()
    assert reg.proc.poll() is None
    nothing_lost(reg, before, contents, tmp_path)


# --- 7: slow retrieval --------------------------------------------------------------------


def test_a_dripping_registry_cannot_hold_a_pull(
    tmp_path: Path, contents: list[Any], subprocess_env: dict[str, str],
) -> None:
    """A registry dripping its answers (headers and bodies) at 2 B/s: each attempt is dropped
    within the rate window, and the pull fails after its retries, not after 900 s."""
    with serve_registry(tmp_path / "served", subprocess_env) as reg:
        reg.publish(contents[0], "1")
        before = reg.snapshot()
        cfg = TransferConfig(min_rate_window_s=2.0, retries=1, backoff_base_s=0.01,
                             backoff_max_s=0.05, free_disk_margin_bytes=0)
        assert cfg.request_deadline_s == 900 and cfg.read_timeout_s == 30
        with RegistryServer(reg.root) as dripping:
            dripping.drip_bytes_per_s = 2.0
            start = time.monotonic()
            with pytest.raises(FetchFailedError):
                update(parse_ref(f"{MODEL}@1", dripping.url), state_dir=tmp_path / "s",
                       trusted=load_trusted_keys(reg.trusted), cfg=cfg)
            held = time.monotonic() - start
        assert held < 2 * 2.0 + 1.0, held  # two attempts of one window each
        print(f"a registry dripping at 2 B/s was dropped after {held:.1f} s (2 attempts, "
              "2 s window)")
        nothing_lost(reg, before, contents, tmp_path)
