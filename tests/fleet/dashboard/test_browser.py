"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by
Playwright) against a real ``fleetctl controller --forever`` and ``fleetctl dashboard``
(subprocesses), with simulated devices on the real broker.

The page is loaded before the controller starts; it must then show the rollout move (wave 0
done, waiting for approval) without a reload, take the operator's login, and its approve
button must move the rollout on: the state db says so, and so does the page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleet.mqtt import BrokerConfig
from fleet.rollout.store import FleetStore
from fleet.sim.fleet import SimFleet
from tests.fleet.conftest import REPO, fleetctl_argv
from tests.support.waiting import until

CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-test-operator-token-0123456789"
SCREENSHOT_ENV = "EDGETRAIN_DASHBOARD_SCREENSHOT"
"""Set to a path (docs/img/dashboard.png) to keep the page's screenshot there."""


def _skip_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing: apt-get install chromium (make services)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: pip install -e '.[dev]'"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _state(db: str, rid: str) -> str:
    store = FleetStore(db)
    try:
        r = store.rollout(rid)
        return "" if r is None else r.state
    finally:
        store.close()


@pytest.fixture
def dashboard(broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str],
              fleet_db: str) -> Iterator[str]:
    """``fleetctl dashboard`` on a free loopback port with an operator token; its URL."""
    token = tmp_path / "operator.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    argv = [*fleetctl_argv(broker, tmp_path, fleet_db), "dashboard", "--port", "0",
            "--operator-token-file", str(token)]
    proc = subprocess.Popen(argv, env=subprocess_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"fleetctl dashboard printed nothing: {proc.stderr.read()}"  # type: ignore[union-attr]
        out = json.loads(line)
        assert out["writable"] is True
        # An observer on the controller's host: it runs at a lower priority (--nice 10).
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, mine + 10)
        yield str(out["dashboard"])
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read()  # type: ignore[union-attr]


def test_the_page_follows_a_rollout_live_and_its_approve_button_moves_it_on(
    sim_fleet: Callable[..., SimFleet], fleetctl: Callable[..., subprocess.CompletedProcess[str]],
    broker: BrokerConfig, tmp_path: Path, subprocess_env: dict[str, str], fleet_db: str,
    dashboard: str,
) -> None:
    from playwright.sync_api import expect, sync_playwright

    sim_fleet(devices=6, telemetry_s=0.5, behavior={"job_duration_s": 0.3},
              overrides={"sim-0005": {"fail": True, "job_duration_s": 0.3}})
    r = fleetctl("rollout", "create", "--detach", "--name", "gated", "--group", "sim",
                 "--job", "deploy", "--args", '{"version": "v2"}', "--waves", "1,100%",
                 "--approve-waves", "--abort-failure-rate", "0.5")
    assert r.returncode == 0, r.stderr
    ctl: subprocess.Popen[str] | None = None
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(dashboard)
            card = page.locator("#rollout-gated")
            # Before the controller runs: created, wave 0 not started.
            expect(card.locator("h3 .state")).to_have_text("running")
            expect(card.locator('tr[data-wave="0"] .state')).to_have_text("pending")
            expect(page.locator("#live")).to_have_text("live")
            expect(page.locator("#devices tbody tr")).to_have_count(6)
            page.evaluate("window.__notReloaded = true")
            ctl = subprocess.Popen(
                [*fleetctl_argv(broker, tmp_path, fleet_db), "controller", "--forever"],
                env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True)
            # The controller moves: the page follows without a reload.
            expect(card.locator('tr[data-wave="0"] .state')).to_have_text("done",
                                                                         timeout=30_000)
            expect(card.locator("h3 .state")).to_have_text("waiting_approval",
                                                            timeout=30_000)
            assert _state(fleet_db, "gated") == "waiting_approval"
            approve = card.locator("button.approve")
            expect(approve).to_have_text("approve wave 1")
            expect(approve).to_be_disabled()  # not logged in yet
            # Temperatures from telemetry reach the table.
            expect(page.locator('#devices tr[data-device="sim-0000"] td').nth(5)
                   ).to_have_text("45", timeout=10_000)
            page.fill("#token", TOKEN)
            page.click("#login")
            expect(page.locator("#message")).to_have_text("logged in")
            expect(approve).to_be_enabled()
            approve.click()
            # The db moves on (the controller took the request), then the page shows it.
            until(lambda: _state(fleet_db, "gated") == "completed_with_failures", 60,
                  lambda: f"the rollout ended; it is {_state(fleet_db, 'gated')}")
            expect(card.locator("h3 .state")).to_have_text("completed_with_failures",
                                                            timeout=10_000)
            expect(card.locator('tr[data-wave="1"] .state')).to_have_text("done")
            expect(card.locator(".failures summary")).to_have_text("failed devices (1)")
            expect(card.locator(".failures")).to_contain_text("sim-0005")
            expect(page.locator('#devices tr[data-device="sim-0005"]')).to_have_class(
                "attention")
            assert page.evaluate("window.__notReloaded") is True
            assert not errors, errors
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            keep = os.environ.get(SCREENSHOT_ENV)
            if keep:
                dest = Path(keep) if Path(keep).is_absolute() else REPO / keep
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, dest)
        finally:
            browser.close()
            if ctl is not None:
                ctl.terminate()
                try:
                    ctl.wait(20)
                except subprocess.TimeoutExpired:
                    ctl.kill()
                    print(ctl.stderr.read() if ctl.stderr else "", file=sys.stderr)
