"""``fleetctl broker-config``'s files, read as mosquitto will read them. (That the broker
enforces them is shown in tests/security/test_broker_identity.py.)"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.broker.config import MAX_PACKET_BYTES, mosquitto_hash
from fleet.cli import main

INVENTORY = {"devices": {"dev-b": {"groups": ["other", "lab"]}, "dev-a": {"groups": ["lab"]}}}


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str,
        inventory: Any = None) -> tuple[int, Any, str]:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(INVENTORY if inventory is None else inventory))
    rc = main(["broker-config", "--inventory", str(inv), "--out", str(tmp_path / "out"),
               "--secrets", str(tmp_path / "secrets"), "--device-listener", "8883",
               "--operator-listener", "127.0.0.1:1884", *extra])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else None, err


def verify(line: str, password: str) -> bool:
    """Check one password file line the way mosquitto 2 does ($7$ = PBKDF2-SHA512)."""
    _, hashed = line.split(":", 1)
    _, alg, iterations, salt, digest = hashed.split("$")
    dk = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(salt),
                             int(iterations))
    return alg == "7" and base64.b64encode(dk).decode() == digest


def blocks(conf: str) -> list[list[str]]:
    """The conf's settings (comments dropped), cut at each ``listener`` line."""
    out: list[list[str]] = [[]]
    for line in conf.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("listener "):
            out.append([])
        out[-1].append(line)
    return out


def test_files_for_an_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, summary, _ = run(tmp_path, capsys)
    assert rc == 0
    out, sec = tmp_path / "out", tmp_path / "secrets"
    assert (out / "acl-devices").read_text().split("\n\n")[1:] == [
        "user dev-a\ntopic write fleet/v1/dev/dev-a/#\ntopic read fleet/v1/dev/dev-a/cmd/#\n"
        "topic read fleet/v1/group/lab/cmd/#",
        "user dev-b\ntopic write fleet/v1/dev/dev-b/#\ntopic read fleet/v1/dev/dev-b/cmd/#\n"
        "topic read fleet/v1/group/lab/cmd/#\ntopic read fleet/v1/group/other/cmd/#\n",
    ]
    ops = {}
    for block in (out / "acl-operators").read_text().split("\n\n")[1:]:
        rules = [x for x in block.splitlines() if not x.startswith("#")]
        ops[rules[0].removeprefix("user ")] = rules[1:]
    assert set(ops) == {"fleet-controller", "fleet-send", "fleet-watch"}
    assert not any(" write " in r for r in ops["fleet-watch"])
    assert "topic write fleet/v1/group/+/cmd/#" not in ops["fleet-controller"]
    assert "topic write fleet/v1/group/+/cmd/#" in ops["fleet-send"]

    glob, dev, op = blocks((out / "mosquitto.conf").read_text())
    assert glob[0] == "per_listener_settings true"  # before anything it governs
    assert f"max_packet_size {MAX_PACKET_BYTES}" in glob
    assert 64 * 1024 < MAX_PACKET_BYTES <= 72 * 1024
    assert dev == ["listener 8883 0.0.0.0", "allow_anonymous false",
                   "use_username_as_clientid true", f"password_file {out}/passwd-devices",
                   f"acl_file {out}/acl-devices"]
    # Client ids bound to accounts on every listener: no account can take another's session.
    assert op == ["listener 1884 127.0.0.1", "allow_anonymous false",
                  "use_username_as_clientid true",
                  f"password_file {out}/passwd-operators", f"acl_file {out}/acl-operators"]

    for kind, names in (("devices", ["dev-a", "dev-b"]),
                        ("operators", ["fleet-controller", "fleet-send", "fleet-watch"])):
        lines = (out / f"passwd-{kind}").read_text().splitlines()
        assert [x.split(":")[0] for x in lines] == names
        for line, name in zip(lines, names, strict=True):
            pw = (sec / kind / f"{name}.password").read_text().strip()
            assert len(pw) >= 32 and verify(line, pw)
            assert not verify(line, pw + "x")
    assert summary["generated"] == ["operators/fleet-controller", "operators/fleet-send",
                                    "operators/fleet-watch", "devices/dev-a", "devices/dev-b"]
    for path in [*out.iterdir(), *sec.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert stat.S_IMODE(sec.stat().st_mode) == 0o700


def test_a_rerun_keeps_passwords_and_adds_the_new_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, capsys)[0] == 0
    sec = tmp_path / "secrets"
    before = {p.name: p.read_text() for p in sec.rglob("*.password")}
    more = {"devices": {**INVENTORY["devices"], "dev-c": {"groups": []}}}
    rc, summary, _ = run(tmp_path, capsys, inventory=more)
    assert rc == 0 and summary["generated"] == ["devices/dev-c"]
    after = {p.name: p.read_text() for p in sec.rglob("*.password")}
    assert after == {**before, "dev-c.password": after["dev-c.password"]}
    acl = (tmp_path / "out" / "acl-devices").read_text()
    assert "user dev-c\ntopic write fleet/v1/dev/dev-c/#\ntopic read fleet/v1/dev/dev-c/cmd/#\n" \
        in acl and "group" not in acl.split("user dev-c")[1]


def test_operator_supplied_passwords(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "secrets" / "devices" / "dev-a.password"
    mine.parent.mkdir(parents=True)
    mine.write_text("correct-horse-battery-staple\n")
    mine.chmod(0o644)
    rc, _, err = run(tmp_path, capsys)
    assert rc == 2 and str(mine) in err and "chmod 600" in err
    mine.chmod(0o600)
    rc, summary, _ = run(tmp_path, capsys)
    assert rc == 0 and "devices/dev-a" not in summary["generated"]
    line = (tmp_path / "out" / "passwd-devices").read_text().splitlines()[0]
    assert verify(line, "correct-horse-battery-staple")
    mine.write_text("short\n")
    rc, _, err = run(tmp_path, capsys)
    assert rc == 2 and str(mine) in err and "16" in err


@pytest.mark.parametrize("inventory, field", [
    ({"devices": {"dev/a": {}}}, "devices"),
    ({"devices": {"fleetctl-1234": {}}}, "reserved"),
    ({"devices": {"dev-a": {"groups": ["lab/+"]}}}, "group"),
    ({"devices": {"dev-a": {"group": ["lab"]}}}, "devices.dev-a.group"),
    ({"devices": {}}, "devices"),
    ({"hosts": {}}, "hosts"),
])
def test_bad_inventory_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inventory: Any, field: str
) -> None:
    rc, _, err = run(tmp_path, capsys, inventory=inventory)
    assert rc == 2 and field in err and str(tmp_path / "inventory.yaml") in err, err
    assert not (tmp_path / "out").exists()


def test_mutual_tls_and_bad_listeners(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tls = ["--cafile", "ca.crt", "--certfile", "b.crt", "--keyfile", "b.key"]
    rc, summary, _ = run(tmp_path, capsys, *tls, "--require-certificate")
    assert rc == 0 and summary["device_auth"] == "certificate CN"
    _, dev, op = blocks((tmp_path / "out" / "mosquitto.conf").read_text())
    assert {"require_certificate true", "use_identity_as_username true",
            "use_username_as_clientid true"} <= set(dev)
    assert not any(x.startswith("password_file") for x in dev)
    assert "require_certificate true" not in op and any(x.startswith("certfile") for x in op)
    assert not (tmp_path / "out" / "passwd-devices").exists()
    assert run(tmp_path, capsys, "--require-certificate")[0] == 2
    assert run(tmp_path, capsys, "--cafile", "ca.crt")[0] == 2
    rc, _, err = run(tmp_path, capsys, "--device-listener", "1884")
    assert rc == 2 and "1884" in err
    rc, _, err = run(tmp_path, capsys, "--device-listener", "host:port")
    assert rc == 2 and "--device-listener" in err


def test_more_operator_accounts_for_tools_that_run_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, summary, _ = run(tmp_path, capsys, "--operator", "ctl-2=fleet-controller",
                         "--operator", "dashboard=fleet-watch")
    assert rc == 0
    out, sec = tmp_path / "out", tmp_path / "secrets"
    names = ["fleet-controller", "fleet-send", "fleet-watch", "ctl-2", "dashboard"]
    lines = (out / "passwd-operators").read_text().splitlines()
    assert [x.split(":")[0] for x in lines] == names
    for line, name in zip(lines, names, strict=True):
        assert verify(line, (sec / "operators" / f"{name}.password").read_text().strip())
    acl = {}
    for block in (out / "acl-operators").read_text().split("\n\n")[1:]:
        rules = [x for x in block.splitlines() if not x.startswith("#")]
        acl[rules[0].removeprefix("user ")] = rules[1:]
    assert acl["ctl-2"] == acl["fleet-controller"] and acl["dashboard"] == acl["fleet-watch"]
    assert summary["operators"]["dashboard"]["role"] == "fleet-watch"
    assert summary["generated"][3:5] == ["operators/ctl-2", "operators/dashboard"]


@pytest.mark.parametrize("extra, inventory, needle", [
    (["--operator", "ops=fleet-admin"], None, "no role 'fleet-admin'"),
    (["--operator", "ops"], None, "NAME=ROLE"),
    (["--operator", "ops=fleet-send", "--operator", "ops=fleet-watch"], None, "given twice"),
    (["--operator", "fleet-send=fleet-watch"], None, "exists already"),
    (["--operator", "fleetctl-x=fleet-send"], None, "reserved"),
    (["--operator", "a/b=fleet-send"], None, "operator account"),
    # a device and an operator account of one name would take each other's sessions
    (["--operator", "dev-a=fleet-watch"], None, "devices.dev-a"),
    ([], {"devices": {"fleet-watch": {}}}, "devices.fleet-watch"),
])
def test_operator_accounts_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], inventory: Any,
    needle: str,
) -> None:
    rc, _, err = run(tmp_path, capsys, *extra, inventory=inventory)
    assert rc == 2 and needle in err, err
    if needle.startswith("devices."):
        assert str(tmp_path / "inventory.yaml") in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="no mosquitto_passwd")
def test_hash_matches_mosquitto_passwd(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(path), "u", "s3cret"], check=True)
    theirs = path.read_text().strip().split(":", 1)[1]
    salt = base64.b64decode(theirs.split("$")[3])
    assert mosquitto_hash("s3cret", salt) == theirs


def test_help_teaches_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["broker-config", "--help"])
    text = capsys.readouterr().out
    for needle in ("devices:", "use_username_as_clientid", "fleet-controller", "fleet-send",
                   "fleet-watch", "0600", "example:", "fleetctl broker-config --inventory"):
        assert needle in text, needle


# --- the bridged tier (--core); its brokers run in test_broker_tier.py ----------------------

TIER = {"devices": {"dev-a": {"groups": ["lab"], "region": "eu"},
                    "dev-b": {"groups": ["other", "lab"], "region": "us"},
                    "dev-c": {"region": "eu"}}}


def run_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str,
             inventory: Any = None) -> tuple[int, Any, str]:
    return run(tmp_path, capsys, "--core", "core.example:8884", "--region", "us=9883", *extra,
               inventory=TIER if inventory is None else inventory)


def settings(conf: str) -> list[str]:
    return [x for x in conf.splitlines() if x and not x.startswith("#")]


def test_tier_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, summary, _ = run_tier(tmp_path, capsys)
    assert rc == 0
    out, sec = tmp_path / "out", tmp_path / "secrets"
    assert sorted(p.name for p in out.iterdir()) == ["core", "eu", "us"]
    assert summary["regions"]["eu"]["devices"] == 2
    assert summary["regions"]["us"]["device_listener"] == "0.0.0.0:9883"
    assert summary["regions"]["eu"]["device_listener"] == "0.0.0.0:8883"  # --device-listener
    assert summary["core"]["bridge_listener"] == "0.0.0.0:8884"

    core = settings((out / "core" / "mosquitto.conf").read_text())
    assert core[0] == "per_listener_settings true" and "persistence true" in core
    bridge_block = core[core.index("listener 8884 0.0.0.0"):core.index("listener 1884 127.0.0.1")]
    assert bridge_block == ["listener 8884 0.0.0.0", "allow_anonymous false",
                            "use_username_as_clientid true",
                            f"password_file {out}/core/passwd-bridges",
                            f"acl_file {out}/core/acl-bridges"]
    assert not any("passwd-devices" in x for x in core)  # no device logs in at the core
    acl = (out / "core" / "acl-bridges").read_text()
    eu_rules = acl.split("user bridge-eu\n")[1].split("\n\n")[0].splitlines()
    writes = [r.removeprefix("topic write ") for r in eu_rules if " write fleet" in r]
    # What its own region's devices (a and c) may write there, nothing of dev-b (us).
    assert writes == ["fleet/v1/dev/dev-a/#", "fleet/v1/dev/dev-c/#"]
    assert [r for r in eu_rules if " read " in r] == [
        "topic read fleet/v1/dev/+/cmd/#", "topic read fleet/v1/group/+/cmd/#"]
    assert " write fleet/v1/dev/+" not in acl and " write fleet/v1/group" not in acl
    assert "topic write fleet/v1/dev/dev-b/#" in acl.split("user bridge-us\n")[1]
    assert "topic read $SYS/broker/connection/+/state" in (
        out / "core" / "acl-operators").read_text().split("user fleet-watch")[1]

    eu = settings((out / "eu" / "mosquitto.conf").read_text())
    bridge = eu[eu.index("connection bridge-eu"):]
    pw = (sec / "bridges" / "bridge-eu.password").read_text().strip()
    assert bridge[:11] == [
        "connection bridge-eu", "address core.example:8884",
        "bridge_protocol_version mqttv311", "remote_clientid bridge-eu",
        "remote_username bridge-eu", f"remote_password {pw}",
        "local_clientid fleetctl-bridge-eu", "cleansession false", "local_cleansession false",
        "restart_timeout 2 30", "topic fleet/v1/dev/+/status out 1"]
    assert [x for x in bridge if x.startswith("topic ")][1:] == [
        "topic fleet/v1/dev/+/res out 1", "topic fleet/v1/dev/+/evt/# out 1",
        "topic fleet/v1/dev/+/telemetry out 0",
        "topic fleet/v1/dev/dev-a/cmd/# in 1", "topic fleet/v1/dev/dev-c/cmd/# in 1",
        "topic fleet/v1/group/lab/cmd/# in 1"]  # its devices and groups only
    line = next(x for x in (out / "core" / "passwd-bridges").read_text().splitlines()
                if x.startswith("bridge-eu:"))
    assert verify(line, pw)
    assert [x.split(":")[0] for x in (out / "eu" / "passwd-devices").read_text().splitlines()] \
        == ["dev-a", "dev-c"]
    assert "dev-b" not in (out / "eu" / "acl-devices").read_text()
    for path in [*out.rglob("*"), *sec.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    # A re-run keeps every password, the bridges' included.
    before = {p: p.read_text() for p in sec.rglob("*.password")}
    rc, summary, _ = run_tier(tmp_path, capsys)
    assert rc == 0 and summary["generated"] == []
    assert {p: p.read_text() for p in sec.rglob("*.password")} == before


def test_tier_tls_per_broker_certificates(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, _ = run_tier(tmp_path, capsys, "--cafile", "ca.crt", "--certfile",
                        "certs/{broker}.crt", "--keyfile", "certs/{broker}.key")
    assert rc == 0
    core = (tmp_path / "out" / "core" / "mosquitto.conf").read_text()
    eu = (tmp_path / "out" / "eu" / "mosquitto.conf").read_text()
    assert core.count("/certs/core.crt") == 2 and "/certs/eu.crt" in eu
    assert f"bridge_cafile {Path('ca.crt').resolve()}" in eu


@pytest.mark.parametrize("inventory, extra, needle", [
    ({"devices": {"dev-a": {"region": "eu"}, "dev-b": {}}}, [], "devices.dev-b.region"),
    ({"devices": {"dev-a": {"region": "core"}}}, [], "devices.dev-a.region: 'core'"),
    ({"devices": {"dev-a": {"region": "e u"}}}, [], "devices.dev-a.region"),
    (None, ["--region", "ap=9000"], "--region ap"),
    (None, ["--region", "us=9884"], "--region us: given twice"),
    (None, ["--region", "eu"], "NAME=[ADDRESS:]PORT"),
    (None, ["--bridge-listener", "1884"], "share port 1884"),
    (None, ["--operator", "bridge-eu=fleet-watch"], "region eu's bridge account"),
])
def test_bad_tier_is_refused_precisely(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inventory: Any, extra: list[str],
    needle: str,
) -> None:
    rc, _, err = run_tier(tmp_path, capsys, *extra, inventory=inventory)
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "out").exists()


def test_regions_and_tier_options_need_core(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(tmp_path, capsys, inventory=TIER)
    assert rc == 2 and "devices.dev-a.region" in err and "--core" in err
    rc, _, err = run(tmp_path, capsys, "--region", "eu=9000")
    assert rc == 2 and "--core" in err
    rc, _, err = run(tmp_path, capsys, "--core", "core.example")
    assert rc == 2 and "HOST:PORT" in err
    rc, _, err = run(tmp_path, capsys, "--devices-per-bridge", "1")
    assert rc == 2 and "--core" in err
    rc, _, err = run_tier(tmp_path, capsys, "--devices-per-bridge", "0")
    assert rc == 2 and "--devices-per-bridge 0" in err


def test_a_region_past_devices_per_bridge_gets_a_bridge_per_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Region eu (dev-a, dev-c) with one device per bridge: two bridges, each carrying its
    own device's messages out and commands in, the first the region's group commands, each
    an account at the core that may write its own device's topics only."""
    rc, summary, _ = run_tier(tmp_path, capsys, "--devices-per-bridge", "1")
    assert rc == 0
    out, sec = tmp_path / "out", tmp_path / "secrets"
    assert summary["regions"]["eu"]["bridges"] == ["bridge-eu", "bridge-eu@1"]
    assert summary["regions"]["us"]["bridges"] == ["bridge-us"]
    eu = settings((out / "eu" / "mosquitto.conf").read_text())
    first, second = (eu[eu.index(f"connection {b}"):] for b in ("bridge-eu", "bridge-eu@1"))
    first = first[:first.index("connection bridge-eu@1")]
    pw = (sec / "bridges" / "bridge-eu.password").read_text().strip()
    assert f"remote_password {pw}" in first and f"remote_password {pw}" in second
    assert "local_clientid fleetctl-bridge-eu@1" in second
    assert [x for x in first if x.startswith("topic ")] == [
        "topic fleet/v1/dev/dev-a/status out 1", "topic fleet/v1/dev/dev-a/res out 1",
        "topic fleet/v1/dev/dev-a/evt/# out 1", "topic fleet/v1/dev/dev-a/telemetry out 0",
        "topic fleet/v1/dev/dev-a/cmd/# in 1", "topic fleet/v1/group/lab/cmd/# in 1"]
    assert [x for x in second if x.startswith("topic ")] == [
        "topic fleet/v1/dev/dev-c/status out 1", "topic fleet/v1/dev/dev-c/res out 1",
        "topic fleet/v1/dev/dev-c/evt/# out 1", "topic fleet/v1/dev/dev-c/telemetry out 0",
        "topic fleet/v1/dev/dev-c/cmd/# in 1"]
    acl = (out / "core" / "acl-bridges").read_text()
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in acl.split("\n\n")[1:]}
    assert [r for r in blocks["user bridge-eu@1"] if " write fleet" in r] == [
        "topic write fleet/v1/dev/dev-c/#"]
    assert "topic write $SYS/broker/connection/bridge-eu@1/state" in blocks["user bridge-eu@1"]
    passwd = dict(x.split(":", 1) for x in (out / "core" / "passwd-bridges").read_text()
                  .splitlines())
    assert sorted(passwd) == ["bridge-eu", "bridge-eu@1", "bridge-us"]
    assert verify(f"bridge-eu@1:{passwd['bridge-eu@1']}", pw)
    assert summary["generated"].count("bridges/bridge-eu") == 1


def test_help_teaches_the_tier_and_its_example_runs_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SystemExit):
        main(["broker-config", "--help"])
    text = capsys.readouterr().out
    for needle in ("--core HOST:PORT", "region: eu", "bridge-<region>", "{broker}",
                   "cleansession false", "example, bridged tier"):
        assert needle in text, needle
    example = text.split("example, bridged tier")[1]
    cmd = example[example.index("fleetctl broker-config"):example.index("chown")]
    argv = cmd.replace("\\\n", " ").split()[1:]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(
        {"devices": {"d1": {"groups": ["line-3"], "region": "eu"},
                     "d2": {"groups": ["line-3"], "region": "us"}}}))
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["core", "eu", "us"]
