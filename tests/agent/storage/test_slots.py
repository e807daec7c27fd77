"""A/B slots: atomic switch, rollback, crash safety at every step, GC, refusals on load."""

from __future__ import annotations

import copy
import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.finetune.active import load_active
from agent.storage.chunk_store import ChunkStore
from agent.storage.gc import gc
from agent.storage.lock import StateLock
from agent.storage.slots import ModelSlots
from agent.storage.update import pull, update
from agent.storage.verify import verify_slot
from registry.errors import (
    CorruptSlotError,
    NoPreviousVersionError,
    PickleRefusedError,
    StateBusyError,
    TensorHashError,
)
from registry.refs import parse_ref
from registry.signing import load_trusted_keys
from registry.transfer import TransferConfig


def trusted(key: Any) -> dict:
    return load_trusted_keys(key.trusted_dir)


def perturbed(model: torch.nn.Module, names: list[str], seed: int) -> torch.nn.Module:
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name in names:
                p.add_(torch.randn(p.shape, generator=g))
    return new


def install(publisher: Any, state: Path, version: str, key: Any, cfg: TransferConfig) -> Any:
    ref = parse_ref(f"{publisher.root.as_uri()}/digits/{version}")
    return update(ref, state_dir=state, trusted=trusted(key), cfg=cfg)


def active_version(state: Path, key: Any) -> str:
    """Load the active model through safetensors after verifying every byte of its slot."""
    loaded = load_active(state, "digits", trusted=trusted(key), verify=True)
    loaded.module(torch.zeros(1, 1, 8, 8))
    return loaded.manifest.version


@pytest.fixture
def three_versions(new_model: Any, publisher: Any) -> list[torch.nn.Module]:
    v1 = new_model()
    v2 = perturbed(v1, ["3.weight", "11.weight"], seed=2)
    v3 = perturbed(v2, ["5.weight", "17.bias"], seed=3)
    publisher.publish(v1, "1")
    publisher.publish(v2, "2", parent="1")
    publisher.publish(v3, "3", parent="2")
    return [v1, v2, v3]


def test_install_switches_slots_and_rollback_goes_back_and_forth(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = install(publisher, state, "1", upstream_key, fast_transfers).switch
    second = install(publisher, state, "2", upstream_key, fast_transfers).switch
    assert (first.active.slot, second.active.slot) == ("a", "b")
    assert os.readlink(state / "models/digits/current") == "slots/b"
    slots = ModelSlots(state, "digits")
    assert slots.standby() is not None and slots.standby().version == "1"  # type: ignore[union-attr]

    back = slots.rollback(trusted(upstream_key))
    assert (back.active.version, back.previous.version) == ("1", "2")  # type: ignore[union-attr]
    x = torch.randn(3, 1, 8, 8)
    loaded = load_active(state, "digits", trusted=trusted(upstream_key), verify=True)
    assert torch.equal(loaded.module(x), three_versions[0].eval()(x))
    assert slots.rollback(trusted(upstream_key)).active.version == "2"  # and forth again

    # The next install overwrites the standby slot (v1), never the active one (v2).
    third = install(publisher, state, "3", upstream_key, fast_transfers).switch
    assert (third.active.slot, third.previous.version) == ("a", "2")  # type: ignore[union-attr]
    assert active_version(state, upstream_key) == "3"


def test_rollback_needs_a_previous_version(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    state = tmp_path / "state"
    install(publisher, state, "1", upstream_key, fast_transfers)
    with pytest.raises(NoPreviousVersionError, match="only 1 is installed"):
        ModelSlots(state, "digits").rollback(trusted(upstream_key))
    cli = subprocess.run(
        [sys.executable, "-m", "agent.cli", "rollback", "--state-dir", str(state),
         "--trusted-keys", str(upstream_key.trusted_dir)],
        capture_output=True, text=True, env=subprocess_env, timeout=60,
    )
    assert cli.returncode == 2 and "no previous version" in cli.stderr
    install(publisher, state, "2", upstream_key, fast_transfers)
    cli = subprocess.run(
        [sys.executable, "-m", "agent.cli", "rollback", "digits", "--state-dir", str(state),
         "--trusted-keys", str(upstream_key.trusted_dir)],
        capture_output=True, text=True, env=subprocess_env, timeout=60,
    )
    assert cli.returncode == 0 and "rolled back: digits@1 active (slot a)" in cli.stdout
    assert active_version(state, upstream_key) == "1"


def test_rollback_refuses_a_corrupted_previous_slot(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    install(publisher, state, "1", upstream_key, fast_transfers)
    install(publisher, state, "2", upstream_key, fast_transfers)
    model_file = state / "models/digits/slots/a/model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-7] ^= 0x10
    model_file.write_bytes(bytes(data))
    with pytest.raises(CorruptSlotError, match=r"failed verification.*does not match its hash"):
        ModelSlots(state, "digits").rollback(trusted(upstream_key))
    assert active_version(state, upstream_key) == "2"


def test_rollback_is_atomic_for_a_concurrent_reader(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    install(publisher, state, "1", upstream_key, fast_transfers)
    install(publisher, state, "2", upstream_key, fast_transfers)
    seen: set[str] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:  # what a serving process does: resolve current, read the slot
        slots = ModelSlots(state, "digits")
        while not stop.is_set():
            try:
                active = slots.active()
                assert active is not None and (active.path / "COMPLETE").is_file()
                seen.add(active.version)
            except BaseException as e:
                errors.append(e)
                return

    t = threading.Thread(target=reader)
    t.start()
    slots = ModelSlots(state, "digits")
    for _ in range(40):
        slots.rollback(None)
    stop.set()
    t.join()
    assert errors == [] and seen == {"1", "2"}


# ---------------------------------------------------------------------------------------------
# Crash safety: SIGKILL at every file-system mutation, then at random instants of a real pull

KILL_DRIVER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path

    from agent.storage.chunk_store import ChunkStore
    from agent.storage.slots import ModelSlots
    from registry.signing import load_trusted_keys, verify_signed_manifest

    op, state, kill_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    WATCH = {"os.rename", "os.symlink", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree",
             "os.truncate"}
    events = 0

    def writes(args):
        mode, flags = args[1], args[2]
        if isinstance(mode, str):
            return any(c in mode for c in "wax+")
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    def hook(event, args):
        global events
        if event in WATCH or (event == "open" and writes(args)):
            events += 1
            if events == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    slots = ModelSlots(state, "digits")
    if op == "install":
        body, sig = Path(sys.argv[4]).read_bytes(), Path(sys.argv[5]).read_bytes()
        manifest, key = verify_signed_manifest(body, sig, load_trusted_keys(Path(sys.argv[6])))
        sys.addaudithook(hook)
        slots.install(manifest, body, sig, ChunkStore(state), key)
    else:
        keys = load_trusted_keys(Path(sys.argv[4]))
        sys.addaudithook(hook)
        slots.rollback(keys)
    print("EVENTS", events)
""")


def run_killed(tmp_path: Path, env: dict[str, str], args: list[str], kill_at: int) -> Any:
    driver = tmp_path / "kill_driver.py"
    driver.write_text(KILL_DRIVER)
    return subprocess.run([sys.executable, str(driver), args[0], args[1], str(kill_at), *args[2:]],
                          capture_output=True, text=True, env=env, timeout=60)


def enumerate_kills(tmp_path: Path, env: dict[str, str], base: Path, extra: list[str],
                    op: str, key: Any) -> tuple[list[str], str]:
    """Run ``op`` once to count its file-system mutations, then once per mutation, SIGKILLed
    just before it. Returns the active version after each kill, and after the complete run."""
    dry = tmp_path / "dry"
    shutil.copytree(base, dry, symlinks=True)
    done = run_killed(tmp_path, env, [op, str(dry), *extra], 0)
    assert done.returncode == 0, done.stderr
    total = int(done.stdout.split()[-1])
    assert total >= 3
    outcomes = []
    for k in range(1, total + 1):
        state = tmp_path / f"kill{k}"
        shutil.copytree(base, state, symlinks=True)
        killed = run_killed(tmp_path, env, [op, str(state), *extra], k)
        assert killed.returncode == -signal.SIGKILL, (k, killed.stderr)
        outcomes.append(active_version(state, key))
        shutil.rmtree(state)
    return outcomes, active_version(dry, key)


def test_sigkill_at_every_step_of_an_install_leaves_old_or_new(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    base = tmp_path / "base"
    install(publisher, base, "1", upstream_key, fast_transfers)
    install(publisher, base, "2", upstream_key, fast_transfers)
    pulled = pull(parse_ref(f"{publisher.root.as_uri()}/digits/3"), state_dir=base,
                  trusted=trusted(upstream_key), cfg=fast_transfers)
    (tmp_path / "m.json").write_bytes(pulled.verified.manifest_bytes)
    (tmp_path / "m.sig").write_bytes(pulled.verified.signature_bytes)
    signed = [str(tmp_path / "m.json"), str(tmp_path / "m.sig"), str(upstream_key.trusted_dir)]
    versions, completed = enumerate_kills(
        tmp_path, subprocess_env, base, signed, "install", upstream_key,
    )
    # A kill before any of the ~20 steps (the last one is the rename of `current`) leaves the
    # old model; the completed run leaves the new one. Nothing in between is ever active.
    assert versions == ["2"] * len(versions) and len(versions) >= 10
    assert completed == "3"
    # After any of those crashes, the next install completes (leftovers are cleaned up).
    state = tmp_path / "again"
    shutil.copytree(base, state, symlinks=True)
    killed = run_killed(tmp_path, subprocess_env, ["install", str(state), *signed], 7)
    assert killed.returncode == -9
    install(publisher, state, "3", upstream_key, fast_transfers)
    assert active_version(state, upstream_key) == "3"
    assert not [p for p in (state / "models/digits").rglob(".*") if p.name != ".."]


def test_sigkill_at_every_step_of_a_rollback_leaves_old_or_new(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    base = tmp_path / "base"
    install(publisher, base, "1", upstream_key, fast_transfers)
    install(publisher, base, "2", upstream_key, fast_transfers)
    versions, completed = enumerate_kills(
        tmp_path, subprocess_env, base, [str(upstream_key.trusted_dir)], "rollback", upstream_key
    )
    assert versions == ["2"] * len(versions) and completed == "1"


def test_sigkill_during_real_pulls_always_leaves_a_loadable_verified_model(
    new_model: Any, publisher: Any, registry_server: Any, upstream_key: Any,
    tmp_path: Path, subprocess_env: dict[str, str],
) -> None:
    """12 `agentctl pull` processes killed with SIGKILL at random instants (download, assembly,
    switch, or after the end); each time the active slot must load and verify."""
    trials = 12
    models = [new_model()]
    for v in range(2, trials + 2):
        models.append(perturbed(models[-1], [f"{2 * (v % 8) + 1}.weight", "17.weight"], seed=v))
    for v, m in enumerate(models, start=1):
        publisher.publish(m, str(v), parent=str(v - 1) if v > 1 else None)
    state = tmp_path / "state"
    cfg = TransferConfig(free_disk_margin_bytes=0)
    update(parse_ref("digits@1", registry_server.url), state_dir=state,
           trusted=trusted(upstream_key), cfg=cfg)
    rng = random.Random(7)
    active, killed_running = "1", 0
    for v in range(2, trials + 2):
        registry_server.reset()
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "pull", f"digits@{v}", "--registry",
             registry_server.url, "--state-dir", str(state), "--trusted-keys",
             str(upstream_key.trusted_dir), "--max-rate", "1M", "--no-progress"],
            env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        meta = sum((publisher.root / f"digits/{v}" / f).stat().st_size
                   for f in ("manifest.json", "manifest.sig"))
        deadline = time.monotonic() + 60
        while registry_server.stats()["bytes_served"] <= meta:  # wait until chunks flow
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.3))  # the download itself takes ~0.15 s at 1 MiB/s
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed_running += 1
        proc.wait(timeout=60)
        if proc.stderr:
            proc.stderr.close()
        now = active_version(state, upstream_key)
        assert now in (active, str(v)), (v, now)
        active = now
        with StateLock(state, wait_s=0):  # the dead process's lock went with it
            pass
    assert killed_running >= trials // 2  # most kills landed while the pull was running
    # Whatever the kills left (partials, leftovers), the next pull completes and cleans up.
    last = str(trials + 1)
    update(parse_ref(f"digits@{last}", registry_server.url), state_dir=state,
           trusted=trusted(upstream_key), cfg=cfg)
    assert active_version(state, upstream_key) == last
    assert not any((state / "chunks" / "partial").iterdir())


# ---------------------------------------------------------------------------------------------
# Loading refusals, garbage collection, the lock


def test_load_refuses_a_pickle_swapped_into_the_slot(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    install(publisher, state, "1", upstream_key, fast_transfers)
    model_file = state / "models/digits/slots/a/model.safetensors"
    original = model_file.read_bytes()
    torch.save(three_versions[0].state_dict(), model_file)
    with pytest.raises(PickleRefusedError, match="pickle"):
        load_active(state, "digits")
    model_file.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(TensorHashError):
        verify_slot(model_file.parent, trusted(upstream_key))
    model_file.write_bytes(original)
    assert active_version(state, upstream_key) == "1"


def test_current_pointing_elsewhere_is_never_followed(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    install(publisher, state, "1", upstream_key, fast_transfers)
    current = state / "models/digits/current"
    current.unlink()
    current.symlink_to("/etc")
    with pytest.raises(CorruptSlotError, match="not slots/a or slots/b"):
        load_active(state, "digits")


def test_gc_keeps_exactly_the_chunks_of_installed_slots(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    for v in ("1", "2", "3"):
        result = install(publisher, state, v, upstream_key, fast_transfers)
    slots = ModelSlots(state, "digits")
    active, standby = slots.active(), slots.standby()
    assert active is not None and standby is not None
    wanted = {c.sha256 for s in (active, standby) for c in s.manifest.chunks}
    store = ChunkStore(state)
    assert store.hashes() == wanted
    assert result.gc.removed_chunks > 0  # v1's own chunks went when its slot was reused
    # A stray partial and an unreferenced chunk are collected too.
    store.partial_dir.mkdir(exist_ok=True)
    (store.partial_dir / ("ab" * 32 + ".part")).write_bytes(b"x")
    stray = store.path("cd" * 32)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"y")
    report = gc(state)
    assert report.removed_chunks == 1 and store.hashes() == wanted
    assert not any(store.partial_dir.iterdir())


def test_state_lock_excludes_a_second_writer(tmp_path: Path) -> None:
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with StateLock(tmp_path):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        with pytest.raises(StateBusyError, match=f"pid {os.getpid()}"):
            StateLock(tmp_path, wait_s=0.1).__enter__()
    finally:
        release.set()
        t.join()
    with StateLock(tmp_path, wait_s=0), StateLock(tmp_path, wait_s=0):  # re-entrant per thread
        fd = os.open(tmp_path / "lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)


def test_agentctl_models_and_gc(
    three_versions: list, publisher: Any, upstream_key: Any, fast_transfers: TransferConfig,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.cli import main as agentctl

    state = tmp_path / "state"
    assert agentctl(["models", "--state-dir", str(state)]) == 0
    assert "no models installed" in capsys.readouterr().out
    install(publisher, state, "1", upstream_key, fast_transfers)
    install(publisher, state, "2", upstream_key, fast_transfers)
    assert agentctl(["models", "--state-dir", str(state)]) == 0
    # The key that verified the version, with its id: not the signer the manifest names.
    assert capsys.readouterr().out.strip() == (
        f"digits: active 2 (slot b, sequence 2, verified by upstream "
        f"({upstream_key.signing.key_id})); standby 1; highest sequence 2"
    )
    assert agentctl(["gc", "--state-dir", str(state)]) == 0
    assert "gc removed 0 chunks" in capsys.readouterr().out
