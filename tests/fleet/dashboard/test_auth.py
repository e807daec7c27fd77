"""The dashboard's write checks, through its real application (Starlette's TestClient) over a
real state db: login with the operator token, the session cookie, the CSRF token, the origin;
read-only mode; and that an accepted button posts the same request ``fleetctl rollout`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from fleet.dashboard.app import Dashboard
from fleet.dashboard.auth import COOKIE, Operators, TokenFileError, read_token
from fleet.dashboard.live import Hub
from fleet.dashboard.snapshot import FleetReader
from fleet.rollout.plan import validate_plan
from fleet.rollout.store import FleetStore

ORIGIN = "http://127.0.0.1:8780"
TOKEN = "t0ken-of-the-operator-0123456789"


def _db(tmp_path: Path) -> str:
    db = str(tmp_path / "fleet.db")
    store = FleetStore(db)
    plan = validate_plan({"name": "gated", "group": "sim", "job": "deploy",
                          "args": {"version": "v2"}, "waves": ["1", "100%"],
                          "approve_waves": True}, "test")
    r = store.create_rollout(plan, ["sim-0000", "sim-0001"])
    store.set_rollout_state(r.id, "waiting_approval")
    wave0 = store.waves(r.id)[0]
    wave0.state = "done"
    store.save_wave(wave0)
    store.close()
    return db


def _client(db: str, token: str | None) -> Iterator[TestClient]:
    reader = FleetReader(db)
    hub = Hub(reader, None)
    hub.refresh()
    dash = Dashboard(hub, Operators(token, {ORIGIN, "http://localhost:8780"}), db)
    with TestClient(dash.app, base_url=ORIGIN) as c:
        yield c
    dash.close()
    reader.close()


@pytest.fixture
def db(tmp_path: Path) -> str:
    return _db(tmp_path)


@pytest.fixture
def client(db: str) -> Iterator[TestClient]:
    yield from _client(db, TOKEN)


@pytest.fixture
def readonly(db: str) -> Iterator[TestClient]:
    yield from _client(db, None)


def _login(c: TestClient) -> str:
    r = c.post("/login", json={"token": TOKEN}, headers={"Origin": ORIGIN})
    assert r.status_code == 200, r.text
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert COOKIE in c.cookies
    return str(r.json()["csrf"])


def _request(db: str) -> str | None:
    store = FleetStore(db)
    try:
        r = store.rollout("gated")
        assert r is not None
        return r.request
    finally:
        store.close()


def test_a_logged_in_operator_approves_through_the_store_request_path(
        client: TestClient, db: str) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert "waiting_approval" in page.text and 'name="csrf-token" content=""' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    csrf = _login(client)
    assert f'name="csrf-token" content="{csrf}"' in client.get("/").text
    r = client.post("/rollouts/gated/approve", headers={"Origin": ORIGIN,
                                                        "X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    assert r.json() == {"rollout": "gated", "request": "approve", "wave": 1}
    assert _request(db) == "approve:1"  # what `fleetctl rollout approve gated` posts
    # A request the rollout cannot take is refused with the command line's reason.
    r = client.post("/rollouts/gated/resume", headers={"Origin": ORIGIN, "X-CSRF-Token": csrf})
    assert r.status_code == 200  # waiting_approval takes resume (the controller decides)
    r = client.post("/rollouts/nope/pause", headers={"Origin": ORIGIN, "X-CSRF-Token": csrf})
    assert r.status_code == 404 and "no rollout 'nope'" in r.json()["error"]
    r = client.post("/rollouts/gated/rollback", headers={"Origin": ORIGIN,
                                                         "X-CSRF-Token": csrf})
    assert r.status_code == 404 and "approve, pause, resume, abort" in r.json()["error"]
    # Logged out: the same request with the same token is refused.
    assert client.post("/logout", headers={"Origin": ORIGIN, "X-CSRF-Token": csrf}
                       ).status_code == 200
    r = client.post("/rollouts/gated/pause", headers={"Origin": ORIGIN, "X-CSRF-Token": csrf})
    assert r.status_code == 403 and "not logged in" in r.json()["error"]


@pytest.mark.parametrize(("headers", "why"), [
    ({"Origin": ORIGIN}, "missing CSRF token"),
    ({"Origin": ORIGIN, "X-CSRF-Token": "forged"}, "wrong CSRF token"),
    ({"Origin": "http://evil.example", "X-CSRF-Token": "{csrf}"}, "cross-origin request"),
    ({"Referer": "http://evil.example/x", "X-CSRF-Token": "{csrf}"}, "cross-origin request"),
    ({"X-CSRF-Token": "{csrf}"}, "without Origin or Referer"),
])
def test_a_write_without_csrf_or_from_another_origin_is_refused(
        client: TestClient, db: str, headers: dict[str, str], why: str) -> None:
    csrf = _login(client)
    sent = {k: v.replace("{csrf}", csrf) for k, v in headers.items()}
    r = client.post("/rollouts/gated/approve", headers=sent)
    assert r.status_code == 403 and why in r.json()["error"], r.text
    assert _request(db) is None  # nothing posted
    # The page's own Referer (no Origin) with the right token passes.
    r = client.post("/rollouts/gated/pause", headers={"Referer": f"{ORIGIN}/",
                                                      "X-CSRF-Token": csrf})
    assert r.status_code == 200 and _request(db) == "pause"


def test_no_session_wrong_token_and_a_foreign_host_are_refused(
        client: TestClient, db: str) -> None:
    r = client.post("/rollouts/gated/approve", headers={"Origin": ORIGIN,
                                                        "X-CSRF-Token": "x"})
    assert r.status_code == 403 and "not logged in" in r.json()["error"]
    client.cookies.set(COOKIE, "made-up-session-id")
    r = client.post("/rollouts/gated/approve", headers={"Origin": ORIGIN,
                                                        "X-CSRF-Token": "x"})
    assert r.status_code == 403 and "not logged in" in r.json()["error"]
    r = client.post("/login", json={"token": TOKEN[:-1] + "X"}, headers={"Origin": ORIGIN})
    assert r.status_code == 403 and r.json()["error"] == "wrong operator token"
    r = client.post("/login", json={"token": TOKEN}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]
    r = client.post("/login", content=b"x" * 5000,
                    headers={"Origin": ORIGIN, "Content-Type": "application/json"})
    assert r.status_code == 413
    # DNS rebinding: a page of another name pointed at this address reads nothing.
    r = client.get("/api/snapshot", headers={"Host": "evil.example:8780"})
    assert r.status_code == 403 and "not this dashboard's address" in r.json()["error"]
    r = client.get("/api/snapshot?page=zero")
    assert r.status_code == 400 and "page" in r.json()["error"]
    assert _request(db) is None


def test_failed_logins_are_rate_limited(client: TestClient) -> None:
    codes = [client.post("/login", json={"token": f"wrong-{i}-0123456789abcdef"},
                         headers={"Origin": ORIGIN}).json()["error"] for i in range(11)]
    assert codes[:10] == ["wrong operator token"] * 10
    assert "too many failed logins" in codes[10]
    r = client.post("/login", json={"token": TOKEN}, headers={"Origin": ORIGIN})
    assert r.status_code == 403  # even the right token, until the window passes


def test_read_only_dashboard_refuses_every_write(readonly: TestClient, db: str) -> None:
    page = readonly.get("/")
    assert page.status_code == 200 and 'data-writable="no"' in page.text
    r = readonly.post("/login", json={"token": TOKEN}, headers={"Origin": ORIGIN})
    assert r.status_code == 403 and "read-only" in r.json()["error"]
    r = readonly.post("/rollouts/gated/approve", headers={"Origin": ORIGIN,
                                                          "X-CSRF-Token": "x"})
    assert r.status_code == 403 and "read-only" in r.json()["error"]
    assert _request(db) is None
    snap = readonly.get("/api/snapshot").json()
    assert snap["rollouts"]["gated"]["waiting_wave"] == 1


def test_token_file_must_be_private_and_long(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    os.chmod(f, 0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token(f)
    os.chmod(f, 0o600)
    assert read_token(f) == TOKEN
    f.write_text("short\n")
    with pytest.raises(TokenFileError, match="at least 16"):
        read_token(f)
    with pytest.raises(TokenFileError, match="No such file"):
        read_token(tmp_path / "missing")


@pytest.mark.parametrize(("argv", "named"), [
    (["--host", "0.0.0.0"], "--allow-remote"),
    (["--host", "0.0.0.0", "--allow-remote"], "--origin"),
    (["--nice", "20"], "--nice"),
    (["--nice", "-1"], "--nice"),
])
def test_a_bad_dashboard_flag_is_a_usage_error_before_anything_opens(
    argv: list[str], named: str, tmp_path: Path,
) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fleet.cli", "--db", str(tmp_path / "fleet.db"),
                        "dashboard", "--port", "0", *argv], capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 2 and named in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "fleet.db").exists()
