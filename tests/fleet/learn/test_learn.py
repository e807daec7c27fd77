"""``fleetctl learn`` end to end: the real command against a real mosquitto and simulated
devices that fine-tune (and upload), evaluate and deploy.

The round logic runs with a stand-in for ``hpc-train`` (``tests/fleet/learn/fake_hpc_train.py``:
same arguments, exit codes and report files, and it counts every call); one test runs the real
``hpc-train aggregate`` and ``publish`` on real device-signed uploads in a folder registry.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleet.db import is_url
from fleet.mqtt import BrokerConfig
from fleet.rollout.store import FleetStore
from fleet.sim.fleet import SimFleet
from tests.fleet.conftest import BOTH_ENGINES, fleetctl_argv
from tests.fleet.learn.learn_sim import (
    Scores,
    learn_status,
    mlp_registry,
    open_jobs,
    read_tensors,
    round_state,
    start,
)

FAKE = f"{sys.executable} {Path(__file__).with_name('fake_hpc_train.py')}"
REAL = f"{sys.executable} -m hpc_core.cli"


@pytest.fixture
def learn_fleet(broker: BrokerConfig) -> Iterator[Callable[..., SimFleet]]:
    started: list[SimFleet] = []

    def run(scores: Scores, **cfg: Any) -> SimFleet:
        fleet = start(broker, scores, **cfg)
        started.append(fleet)
        return fleet

    yield run
    for f in started:
        f.stop()
        assert not f.errors, f.errors


@pytest.fixture
def env(subprocess_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The stand-in hpc-train for every fleetctl (a resumed controller too), its call log."""
    return subprocess_env | {"FAKE_HPC_TRAIN_LOG": str(tmp_path / "tool-calls.jsonl"),
                             "FLEETCTL_HPC_TRAIN": FAKE}


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A trusted-keys folder and a signing key (the fake tool signs nothing; paths must exist)."""
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    key = tmp_path / "upstream.key.pem"
    key.write_text("not a key: the fake publish never reads it\n")
    return {"trusted": trusted, "key": key, "registry": tmp_path / "registry"}


def learn_argv(broker: BrokerConfig, tmp_path: Path, *args: str,
               db: str | None = None) -> list[str]:
    return [*fleetctl_argv(broker, tmp_path, db), "learn", *args]


def start_args(name: str, keys: dict[str, Path], *extra: str, base: str = "v1",
               fake: bool = True) -> list[str]:
    return ["start", name, "--group", "sim", "--model", "digits", "--base", base,
            "--data", "cam0", "--registry", str(keys["registry"]),
            "--trusted-keys", str(keys["trusted"]), "--sign-key", str(keys["key"]),
            *(["--hpc-train", FAKE] if fake else ["--hpc-train", REAL]), *extra]


def tool_calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "tool-calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["argv"] for line in path.read_text().splitlines()]


def calls(tmp_path: Path, tool: str, version: str | None = None,
          base: str | None = None) -> list[list[str]]:
    out = []
    for argv in tool_calls(tmp_path):
        if argv[0] != tool:
            continue
        if version is not None and argv[argv.index("--version") + 1] != version:
            continue
        if base is not None and argv[argv.index("--base") + 1] != base:
            continue
        out.append(argv)
    return out


def opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def ran_twice(fleet: SimFleet) -> dict[str, list[str]]:
    return {d.id: d.executed for d in fleet.devices.values()
            if len(set(d.executed)) != len(d.executed)}


def test_a_round_published_and_deployed_then_one_refused_keeps_its_base(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], keys: dict[str, Path],
    tmp_path: Path, env: dict[str, str],
) -> None:
    # Round 1: every device gains 2 points -> released and deployed. Round 2: sim-0001 loses 5.
    scores = Scores(gains={}, gain=0.02)
    fleet = learn_fleet(scores, devices=4, behavior={"job_duration_s": 0.05})
    scores.by_candidate = {"nl-r2-candidate": {"sim-0001": -0.05}}
    (tmp_path / "upstream-ckpt").mkdir()
    (tmp_path / "upstream.yaml").write_text("data: {source: digits}\n")
    r = subprocess.run(learn_argv(broker, tmp_path, *start_args(
        "nl", keys, "--rounds", "2", "--min-updates", "4", "--max-device-drop", "2",
        "--min-devices", "4", "--deploy", "--timeout-s", "20", "--max-upstream-drop", "1",
        "--eval-personal", "head,norm",
        "--base-checkpoint", str(tmp_path / "upstream-ckpt"),
        "--eval-config", str(tmp_path / "upstream.yaml"))),
        capture_output=True, text=True, env=env | {"FAKE_UPSTREAM_DROP_PTS": "0.5"}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    s = learn_status(tmp_path, "nl")
    assert s["state"] == "finished" and s["base"] == "nl-r1"
    r1, r2 = s["history"]
    assert (r1["outcome"], r1["release"], r1["deploy"]) == ("published", "nl-r1", "succeeded")
    assert r1["updates"] == {"chosen": 4, "combined": 4, "skipped": 0, "dropped": 0, "stale": 0}
    assert r1["evaluation"]["devices"] == 4 and r1["evaluation"]["mean_gain_pts"] == 2.0
    # Each device also scored the candidate with its own head and norms (--eval-personal):
    # reported beside the global score, never gated, not in the gates' device-evals file.
    assert {e["device"]: e["personalized_accuracy"] for e in r1["evaluations"]} == {
        f"sim-000{i}": 0.87 for i in range(4)}
    assert r1["evaluation"]["personalized_accuracy"] == pytest.approx(0.87)
    assert [g["flag"] for g in r1["gates"]] == \
        ["--max-upstream-drop 1", "--min-devices 4", "--max-device-drop 2"]
    assert all(g["passed"] for g in r1["gates"])
    assert (r2["base"], r2["outcome"], r2["release"], r2["deploy"]) == \
        ("nl-r1", "refused", None, None)
    assert "--max-device-drop 2: sim-0001 dropped 5 pts" in r2["reason"]
    # What ran upstream: per round one aggregate of that round's base, the candidate, the
    # release with the device gates (the second refused, exit 4); the evals file as published.
    work = tmp_path / "fleet.db.learn" / "nl"
    assert [opt(a, "--base") for a in calls(tmp_path, "aggregate")] == ["v1", "nl-r1"]
    (cand1,) = calls(tmp_path, "publish", "nl-r1-candidate")
    (cand2,) = calls(tmp_path, "publish", "nl-r2-candidate")
    # The upstream gate scores each candidate against the checkpoint its base came from.
    assert opt(cand1, "--base-checkpoint") == str(tmp_path / "upstream-ckpt")
    assert opt(cand2, "--base-checkpoint") == str(work / "round-1" / "aggregate")
    assert "--device-evals" not in cand1 and "--max-upstream-drop" not in calls(
        tmp_path, "publish", "nl-r1")[0]
    assert len(calls(tmp_path, "publish", "nl-r2")) == 1
    evals = json.loads((work / "round-2" / "device-evals.json").read_text())["evaluations"]
    assert all("personalized_accuracy" not in e for e in evals)
    assert {e["device"]: round(e["candidate_accuracy"] - e["base_accuracy"], 6) for e in evals} \
        == {"sim-0000": 0.02, "sim-0001": -0.05, "sim-0002": 0.02, "sim-0003": 0.02}
    # Round 2 fine-tuned from the release; only the release was ever deployed.
    assert [base for _, base in [(d, v.split("+")[0]) for d, v in scores.uploads]] == \
        ["v1"] * 4 + ["nl-r1"] * 4
    rollouts = {j.split(".")[0].rsplit("-", 1)[0] for d in fleet.devices.values()
                for j in d.executed}
    assert rollouts == {"nl-r1-ft", "nl-r1-ev", "nl-r1-dp", "nl-r2-ft", "nl-r2-ev"}
    assert not ran_twice(fleet)
    assert "learn nl: finished, round 2 of 2, base nl-r1" in r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("ROUND"))
    assert "CAND_ACC  PERS_ACC" in header, r.stdout
    r = subprocess.run(learn_argv(broker, tmp_path, "status", "nl", "--json"),
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["history"] == s["history"]
    assert (tmp_path / "reports" / "learn-nl.png").read_bytes()[:4] == b"\x89PNG"


def test_round_one_can_combine_the_uploads_of_a_fine_tune_rollout_already_run(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], keys: dict[str, Path],
    tmp_path: Path, env: dict[str, str],
) -> None:
    """``--first-updates ROLLOUT``: round 1 aggregates what an operator's fine-tune rollout
    uploaded; no device fine-tunes twice, and the learn leaves that rollout alone."""
    scores = Scores(gains={}, gain=0.02)
    fleet = learn_fleet(scores, devices=3, behavior={"job_duration_s": 0.05})
    ft = {"model": "digits", "version": "v1", "data": "cam0", "steps": {"upload": True}}
    (tmp_path / "ft.json").write_text(json.dumps(ft))
    r = subprocess.run([
        *fleetctl_argv(broker, tmp_path), "rollout", "create", "--name", "ops-ft",
        "--group", "sim", "--job", "finetune", "--args", f"@{tmp_path / 'ft.json'}",
        "--timeout-s", "20"],
        capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(scores.uploads) == 3
    # A rollout that is not a fine-tune with uploads is refused by name.
    r = subprocess.run(learn_argv(broker, tmp_path, *start_args(
        "bad", keys, "--rounds", "1", "--max-device-drop", "2", "--first-updates", "nope")),
        capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "first_updates: nope is not a fine-tune rollout" in \
        learn_status(tmp_path, "bad")["reason"]
    r = subprocess.run(learn_argv(broker, tmp_path, *start_args(
        "fu", keys, "--rounds", "1", "--min-updates", "3", "--max-device-drop", "2",
        "--deploy", "--timeout-s", "20", "--first-updates", "ops-ft")),
        capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    s = learn_status(tmp_path, "fu")
    (r1,) = s["history"]
    assert (r1["outcome"], r1["release"], r1["deploy"]) == ("published", "fu-r1", "succeeded")
    assert r1["updates"]["combined"] == 3
    (agg,) = calls(tmp_path, "aggregate")
    assert sorted(opt(agg, "--updates").split(",")) == sorted(v for _, v in scores.uploads)
    assert len(scores.uploads) == 3  # nobody fine-tuned again
    rollouts = {j.split(".")[0].rsplit("-", 1)[0] for d in fleet.devices.values()
                for j in d.executed}
    assert rollouts == {"ops-ft", "fu-r1-ev", "fu-r1-dp"}
    assert not ran_twice(fleet)
    store = FleetStore(tmp_path / "fleet.db")
    try:
        ops = store.rollout("ops-ft")
        assert ops is not None and ops.state == "succeeded", ops
    finally:
        store.close()


def test_offline_and_slow_devices_do_not_hold_a_round_a_late_upload_counts_next_round(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], keys: dict[str, Path],
    tmp_path: Path, env: dict[str, str],
) -> None:
    # sim-0000/1 answer at once, sim-0002 takes 1.5 s a job, sim-0003 is offline: round 1
    # aggregates the first two; sim-0002's upload of v1 arrives during round 1's evaluation
    # and is combined in round 2 with staleness 1; sim-0003 never holds anything up.
    fast = {"job_duration_s": 0.05}
    fleet = learn_fleet(Scores(), devices=4, behavior=fast,
                        overrides={"sim-0002": {"job_duration_s": 1.5}})
    fleet.crash("sim-0003")
    time.sleep(0.3)
    r = subprocess.run(learn_argv(broker, tmp_path, *start_args(
        "late", keys, "--rounds", "2", "--min-updates", "2", "--max-staleness", "1",
        "--min-devices", "2", "--min-mean-gain", "0", "--timeout-s", "4", "--collect-s", "30")),
        capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"offline": 1' in r.stdout
    s = learn_status(tmp_path, "late")
    r1, r2 = s["history"]
    assert r1["outcome"] == "published" and r2["outcome"] == "published"
    assert {u["device"] for u in r1["chosen"]} == {"sim-0000", "sim-0001"}
    late = [u for u in r2["chosen"] if u["device"] == "sim-0002"]
    assert late and late[0]["staleness"] == 1 and late[0]["release"] == "v1"
    assert late[0]["version"].startswith("v1+sim-0002.")
    assert r2["updates"]["stale"] == 1
    agg2 = calls(tmp_path, "aggregate", base="late-r1")
    assert len(agg2) == 1 and opt(agg2[0], "--max-staleness") == "1"
    assert late[0]["version"] in opt(agg2[0], "--updates").split(",")
    # The offline device was asked, timed out, and is listed as not evaluated.
    assert [d["device"] for d in r1["not_evaluated"]] == ["sim-0003"]
    assert "TIMED_OUT" in r1["not_evaluated"][0]["reason"]
    assert r1["evaluation"]["devices"] == 3
    assert not ran_twice(fleet)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_controller_sigkilled_mid_round_resumes_without_running_anything_again(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], keys: dict[str, Path],
    tmp_path: Path, env: dict[str, str],
) -> None:
    # Jobs outlast a controller's restart (0.5 s down + its start-up): at the first kill the
    # evaluations are still running when the next controller re-sends them, so the devices'
    # DUPLICATE answers are certain. With 0.6 s jobs every result could be back, and taken
    # from the session, before the re-send, and no job was re-sent at all; 4 s jobs fell short
    # once too, in a clean-clone run whose other process loaded both cores.
    fleet = learn_fleet(Scores(), devices=4, behavior={"job_duration_s": 10.0})
    db = tmp_path / "fleet.db"
    env = env | {"FAKE_HPC_TRAIN_SLEEP_S": "2"}
    kill_points: list[Callable[[], bool]] = [
        # 1: round 1's evaluations are out on the devices, one at least accepted by its device
        # (SENT is written before the publish: a kill between the two leaves the device without
        # the job, and its re-send is a first delivery, not a DUPLICATE)
        lambda: (round_state(db, "k") or {}).get("phase") == "evaluate"
        and open_jobs(db, "k-r1-ev", accepted=True) > 0,
        # 2: round 2's aggregation is running (the tool dies with its controller)
        lambda: (round_state(db, "k") or {}).get("round") == 2
        and len(calls(tmp_path, "aggregate", base="k-r1")) == 1,
    ]
    argvs = [learn_argv(broker, tmp_path, *start_args(
        "k", keys, "--rounds", "2", "--min-updates", "4", "--max-device-drop", "2",
        "--min-devices", "4", "--timeout-s", "30")), learn_argv(broker, tmp_path, "run", "k")]
    for i, (argv, reached) in enumerate(zip(argvs, kill_points, strict=True)):
        log = open(tmp_path / f"controller-{i}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 60
        while not reached():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / f"controller-{i}.log").read_text()[-3000:]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)  # results arrive while no controller runs: the session keeps them
    killed_tool = [json.loads(line) for line in
                   (tmp_path / "tool-calls.jsonl").read_text().splitlines()][-1]
    assert killed_tool["argv"][0] == "aggregate"
    time.sleep(0.3)
    assert not _alive(killed_tool["pid"]), "the aggregation outlived its controller"
    r = subprocess.run(learn_argv(broker, tmp_path, "run", "k"), capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    s = learn_status(tmp_path, "k")
    assert s["state"] == "finished" and [h["outcome"] for h in s["history"]] == \
        ["published", "published"]
    # Nothing that finished ran again: one aggregate of v1, one candidate and one release per
    # round; round 2's aggregation ran twice, the first killed with its controller.
    r1, r2 = s["history"]
    assert r1["tool_runs"] == {"aggregate": 1, "candidate": 1, "publish": 1}
    assert r2["tool_runs"] == {"aggregate": 2, "candidate": 1, "publish": 1}
    assert len(calls(tmp_path, "aggregate", base="v1")) == 1
    assert len(calls(tmp_path, "aggregate", base="k-r1")) == 2
    for v in ("k-r1-candidate", "k-r1", "k-r2-candidate", "k-r2"):
        assert len(calls(tmp_path, "publish", v)) == 1, v
    # Every device started every job once; the re-sent ones were answered DUPLICATE.
    assert not ran_twice(fleet)
    for d in fleet.devices.values():
        assert len(d.executed) == 4, (d.id, d.executed)  # r1 ft + ev, r2 ft + ev
    assert sum(d.duplicates for d in fleet.devices.values()) > 0


def test_real_hpc_train_aggregates_the_uploads_and_publishes_behind_the_gates(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], tmp_path: Path,
    env: dict[str, str],
) -> None:
    # A real folder registry: release 1 of a small mlp, device-signed uploads made by the
    # simulated devices' fine-tunes, the real `hpc-train aggregate` and `publish`.
    reg = mlp_registry(tmp_path / "fleet", devices=3)
    scores = Scores(registry=reg, gain=0.01)
    fleet = learn_fleet(scores, devices=3, behavior={"job_duration_s": 0.05})
    keys = {"trusted": reg.trusted, "key": reg.work / "keys" / "upstream.key.pem",
            "registry": reg.root}
    r = subprocess.run(learn_argv(broker, tmp_path, *start_args(
        "real", keys, "--rounds", "1", "--min-updates", "3", "--min-devices", "3",
        "--max-device-drop", "1", "--min-mean-gain", "0.5", "--deploy", "--timeout-s", "60",
        base="1", fake=False)), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = learn_status(tmp_path, "real")
    (r1,) = s["history"]
    uploaded = sorted(v for _, v in scores.uploads)
    assert sorted(r1["combined"]) == uploaded and len(uploaded) == 3
    assert (r1["outcome"], r1["candidate"], r1["release"], r1["deploy"]) == \
        ("published", "real-r1-candidate", "real-r1", "succeeded")
    assert {g["flag"] for g in r1["gates"]} == \
        {"--min-devices 3", "--max-device-drop 1", "--min-mean-gain 0.5"}
    # The release is signed with its lineage and the gate figures; its tensors are the
    # aggregate's (base + mean delta of the three uploads: fedavg, equal samples).
    release, tensors = read_tensors(reg, "real-r1")
    assert release.parent == "1" and release.training.aggregate is not None
    assert sorted(release.training.aggregate.combined) == uploaded
    assert release.training.metrics["gate/devices"] == 3.0
    _, base = read_tensors(reg, "1")
    ups = [read_tensors(reg, v)[1] for v in uploaded]
    for k, v in tensors.items():
        want = base[k] + np.mean([u[k] - base[k] for u in ups], axis=0)
        np.testing.assert_allclose(v, want, atol=1e-6)
    assert {d.model.version for d in fleet.devices.values()} == {"real-r1"}
    assert sorted(reg.store.list_versions("digits")) == sorted(
        ["1", "real-r1-candidate", "real-r1", *uploaded])


def test_a_bad_plan_is_refused_before_anything_is_sent(
    broker: BrokerConfig, keys: dict[str, Path], tmp_path: Path, env: dict[str, str],
) -> None:
    argv = learn_argv(broker, tmp_path, *start_args("bad", keys, "--rounds", "2"))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert "set min_mean_gain or max_device_drop" in r.stderr
    plan = tmp_path / "learn.yaml"
    plan.write_text("rounds: 2\nmax_device_drop: 1\ncolect_s: 5\n")
    r = subprocess.run([*argv, "--plan", str(plan)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "colect_s: unknown field" in r.stderr, r.stderr
    r = subprocess.run([*argv, "--max-device-drop", "1", "--finetune",
                        '{"steps": {"upload": false}}'], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and "steps.upload: the learn sets it" in r.stderr, r.stderr
    r = subprocess.run([*argv, "--max-device-drop", "1", "--dp-noise-multiplier", "1"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "dp_noise_multiplier needs strategy fedavg" in r.stderr
    # Numbered releases count from a numbered base (this one is v1).
    r = subprocess.run([*argv, "--max-device-drop", "1", "--release-versions", "numbered"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "release_versions numbered: the base must be a number like 1, "\
        "got 'v1'" in r.stderr, r.stderr
    assert not (tmp_path / "fleet.db").exists()  # refused before the db was opened


def test_dp_options_reach_the_aggregation_accounted_over_the_learns_rounds(
        keys: dict[str, Path], tmp_path: Path) -> None:
    from fleet.learn.plan import LearnPlan
    from fleet.learn.upstream import aggregate_argv, candidate_argv, release_argv

    plan = LearnPlan.model_validate({
        "name": "private", "group": "sim", "model": "digits", "base": "v1", "data": "cam0",
        "registry": str(keys["registry"]), "trusted_keys": str(keys["trusted"]),
        "sign_key": str(keys["key"]), "max_device_drop": 1, "rounds": 4, "clip_norm": 2.0,
        "dp_noise_multiplier": 1.1, "dp_delta": 1e-5})
    argv = aggregate_argv(plan, "v1", ["dev-0-up"], tmp_path / "agg", targets=12)
    i = argv.index("--dp-noise-multiplier")
    # The expected weight is the devices the learn targets (fixed when it starts), not the
    # uploads that arrived (one here): the fixed denominator of DP-FedAvg.
    assert argv[i:i + 8] == ["--dp-noise-multiplier", "1.1", "--dp-delta", "1e-05",
                             "--dp-rounds", "4", "--dp-expected-weight", "12"]
    assert "--clip-norm" in argv and "--dp-weight-cap" not in argv
    # Under DP the round's report (norms, distances before the noise) is not published.
    assert "--artefact" not in candidate_argv(plan, tmp_path / "agg", "r1-candidate", None)
    assert "--artefact" not in release_argv(plan, tmp_path / "agg", "r1", tmp_path / "e.json")
    plain = LearnPlan.model_validate(plan.model_dump() | {"dp_noise_multiplier": None,
                                                          "dp_delta": None})
    assert "--artefact" in candidate_argv(plain, tmp_path / "agg", "r1-candidate", None)
    set_fields = plan.model_dump() | {"dp_expected_weight": 6.5, "dp_weight_cap": 300}
    argv = aggregate_argv(LearnPlan.model_validate(set_fields), "v1", ["u"], tmp_path / "agg",
                          targets=12)
    i = argv.index("--dp-expected-weight")
    assert argv[i:i + 4] == ["--dp-expected-weight", "6.5", "--dp-weight-cap", "300"]
    with pytest.raises(ValueError, match="dp_expected_weight"):
        LearnPlan.model_validate(plan.model_dump() | {"dp_noise_multiplier": None,
                                                      "dp_delta": None, "dp_weight_cap": 300})


def test_a_median_clip_reaches_the_aggregation_and_is_no_dp_sensitivity(
        keys: dict[str, Path], tmp_path: Path) -> None:
    from pydantic import ValidationError

    from fleet.learn.plan import LearnPlan
    from fleet.learn.upstream import aggregate_argv

    fields = {"name": "robust", "group": "sim", "model": "digits", "base": "v1", "data": "cam0",
              "registry": str(keys["registry"]), "trusted_keys": str(keys["trusted"]),
              "sign_key": str(keys["key"]), "max_device_drop": 1, "rounds": 2}
    for given, passed in (("median", "median"), ("2.5", "2.5")):  # flags arrive as text
        plan = LearnPlan.model_validate({**fields, "clip_norm": given})
        argv = aggregate_argv(plan, "v1", ["dev-0-up"], tmp_path / "agg")
        assert argv[argv.index("--clip-norm") + 1] == passed
    for bad, words in (({"clip_norm": "mean"}, "clip_norm"), ({"clip_norm": 0}, "clip_norm"),
                       ({"clip_norm": "median", "dp_noise_multiplier": 1, "dp_delta": 1e-5},
                        "a numeric clip_norm (the sensitivity; not median)")):
        with pytest.raises(ValidationError, match=re.escape(words)):
            LearnPlan.model_validate({**fields, **bad})
    # Multi-Krum behind the median clip, the pair that held best against sign-flipped updates.
    plan = LearnPlan.model_validate({**fields, "clip_norm": "median", "strategy": "krum",
                                     "krum_f": "2", "krum_keep": "6"})
    argv = aggregate_argv(plan, "v1", ["dev-0-up"], tmp_path / "agg")
    assert argv[argv.index("--krum-f"):argv.index("--krum-f") + 4] == [
        "--krum-f", "2", "--krum-keep", "6"]
    for bad in ({"krum_keep": 6}, {"strategy": "krum", "krum_keep": 0}):
        with pytest.raises(ValidationError, match="krum_keep"):
            LearnPlan.model_validate({**fields, **bad})


def test_numbered_releases_count_from_the_base_and_candidates_keep_their_names(
        keys: dict[str, Path]) -> None:
    from fleet.learn.plan import LearnPlan

    fields = {"name": "nightly", "group": "sim", "model": "digits", "base": "7",
              "data": "cam0", "registry": str(keys["registry"]),
              "trusted_keys": str(keys["trusted"]), "sign_key": str(keys["key"]),
              "max_device_drop": 1, "rounds": 3, "deploy": True}
    plan = LearnPlan.model_validate({**fields, "release_versions": "numbered"})
    assert [plan.release_version(k) for k in (1, 2, 3)] == ["8", "9", "10"]
    assert plan.release_version(2, candidate=True) == "nightly-r2-candidate"
    assert plan.job_args("deploy", 2, "8")["version"] == "9"
    assert plan.job_args("evaluate", 2, "8")["version"] == "nightly-r2-candidate"
    # A version someone else published stops the learn; the fix it names fits the name.
    assert "newest numbered release" in plan.name_fix("8")
    assert "version_prefix" in plan.name_fix("nightly-r1-candidate")
    prefixed = LearnPlan.model_validate(fields)
    assert prefixed.release_version(1) == "nightly-r1"
    assert "version_prefix" in prefixed.name_fix("nightly-r1")


def test_the_server_step_reaches_the_aggregation_and_is_bounded(
        keys: dict[str, Path], tmp_path: Path) -> None:
    from pydantic import ValidationError

    from fleet.learn.plan import LearnPlan
    from fleet.learn.upstream import aggregate_argv

    fields = {"name": "stepped", "group": "sim", "model": "digits", "base": "v1",
              "data": "cam0", "registry": str(keys["registry"]),
              "trusted_keys": str(keys["trusted"]), "sign_key": str(keys["key"]),
              "max_device_drop": 1, "rounds": 2}
    plain = aggregate_argv(LearnPlan.model_validate(fields), "v1", ["u"], tmp_path / "a")
    assert "--server-lr" not in plain  # the tool's own default: plain averaging
    argv = aggregate_argv(LearnPlan.model_validate({**fields, "server_lr": 2.5}), "v1", ["u"],
                          tmp_path / "a")
    assert argv[argv.index("--server-lr") + 1] == "2.5"
    for bad in (0, -1, 101):
        with pytest.raises(ValidationError, match="server_lr"):
            LearnPlan.model_validate({**fields, "server_lr": bad})


@pytest.mark.parametrize(("fail", "said"), [
    ("aggregate:2", ["hpc-train aggregate exit 2", "--trusted-keys holds no key"]),
    # A crash exits 1 like "too few updates": it must stop the learn, not skip the round.
    ("aggregate:crash", ["hpc-train aggregate exit 70", "RuntimeError: simulated crash"]),
])
def test_a_tool_that_fails_stops_the_learn_and_resume_goes_on_from_that_phase(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], keys: dict[str, Path],
    tmp_path: Path, env: dict[str, str], fail: str, said: list[str],
) -> None:
    fleet = learn_fleet(Scores(), devices=2, behavior={"job_duration_s": 0.05})
    r = subprocess.run(learn_argv(broker, tmp_path, *start_args(
        "f", keys, "--min-updates", "2", "--min-mean-gain", "1", "--rounds", "1")),
        capture_output=True, text=True, env=env | {"FAKE_HPC_TRAIN_FAIL": fail},
        timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    s = learn_status(tmp_path, "f")
    assert s["state"] == "failed" and s["current"]["phase"] == "aggregate"
    assert f"round 1, aggregate: {said[0]}" in s["reason"]
    assert said[1] in s["reason"]
    r = subprocess.run(learn_argv(broker, tmp_path, "list"), capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0 and "f   failed  1/1" in r.stdout, r.stdout
    # Fixed: resume, and the next controller goes on from the aggregation (the devices'
    # fine-tunes are not asked for again).
    r = subprocess.run(learn_argv(broker, tmp_path, "resume", "f"), capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(learn_argv(broker, tmp_path, "run", "f"), capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    s = learn_status(tmp_path, "f")
    assert s["state"] == "finished" and s["history"][0]["outcome"] == "published"
    assert s["history"][0]["tool_runs"] == {"aggregate": 2, "candidate": 1, "publish": 1}
    assert all(len(d.executed) == 2 for d in fleet.devices.values())  # one ft, one ev each
    r = subprocess.run(learn_argv(broker, tmp_path, "resume", "f"), capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and "only a failed learn is resumed" in r.stderr


@BOTH_ENGINES
def test_the_fleet_controller_forever_drives_a_detached_learn_to_its_end(
    broker: BrokerConfig, learn_fleet: Callable[..., SimFleet], keys: dict[str, Path],
    tmp_path: Path, env: dict[str, str], fleet_db: str,
) -> None:
    """`fleetctl learn start --detach` only creates the learn; the db's controller,
    `fleetctl controller --forever`, drives its rounds (not only their rollouts). On
    PostgreSQL two replicas run: the one that leases the learn drives it, the tools run once."""
    fleet = learn_fleet(Scores(gains={}, gain=0.02), devices=2,
                        behavior={"job_duration_s": 0.05})
    args = start_args("fc", keys, "--rounds", "1", "--min-updates", "2", "--max-device-drop",
                      "2", "--min-devices", "2", "--timeout-s", "20", "--detach")
    replicas = 1
    if is_url(fleet_db):
        r = subprocess.run(learn_argv(broker, tmp_path, *args, db=fleet_db),
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2 and "needs --work-dir" in r.stderr, r.stderr
        args, replicas = [*args, "--work-dir", str(tmp_path / "learn-work")], 2
    r = subprocess.run(learn_argv(broker, tmp_path, *args, db=fleet_db),
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert learn_status(tmp_path, "fc", fleet_db)["state"] == "running"
    procs = []
    for i in range(replicas):
        log = open(tmp_path / f"controller{i}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [*fleetctl_argv(broker, tmp_path, fleet_db), "controller", "--forever",
             "--hpc-train", FAKE], env=env, stdout=log, stderr=log))
        log.close()
    try:
        deadline = time.monotonic() + 90
        while learn_status(tmp_path, "fc", fleet_db)["state"] == "running":
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                (tmp_path / "controller0.log").read_text()[-3000:]
            time.sleep(0.1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    s = learn_status(tmp_path, "fc", fleet_db)
    assert s["state"] == "finished" and s["history"][0]["outcome"] == "published"
    assert s["history"][0]["tool_runs"] == {"aggregate": 1, "candidate": 1, "publish": 1}
    assert not ran_twice(fleet)
