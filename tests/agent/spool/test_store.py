"""The spool: quota and caps under a flood, age retention, hard-example retention,
pseudo-labels, kill -9 mid-write, a full disk, two processes and threads recording at once."""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.spool import store as store_mod
from agent.spool.config import MB, SpoolConfig
from agent.spool.index import DEAD
from agent.spool.segment import NAME_RE, read_header, read_samples
from agent.spool.store import Spool

REPO = Path(__file__).resolve().parents[3]
BLOCK = 4096


def cfg(**over: Any) -> SpoolConfig:
    return SpoolConfig(**{"quota_mb": 64.0, "min_free_disk_mb": 0.0, **over})


def quota_for(samples: int) -> float:
    """A quota (MB) whose live share holds ``samples`` one-sample 8x8 segments (one block
    each), and not one more."""
    return (samples * BLOCK + BLOCK // 2) / (1 - store_mod.COMPACT_RESERVE) / MB


def sample(i: float, shape: tuple[int, ...] = (1, 8, 8)) -> np.ndarray:
    """A sample that says which it is: every pixel is its id."""
    return np.full(shape, i, np.float32)


def two_class(a: float) -> np.ndarray:
    """Logits whose margin for label 0 is tanh(a / 2): larger a, surer model."""
    return np.array([a, 0.0])


def kept_ids(spool: Spool, tmp: Path) -> list[int]:
    info = spool.snapshot(tmp / "ids.npz")
    with np.load(info.path, allow_pickle=False) as z:
        return sorted(int(v) for v in z["x"][:, 0, 0, 0])


def disk_bytes(root: Path) -> int:
    """What the segment files really take on disk."""
    return sum(p.stat().st_blocks * 512 for p in root.glob("*.seg"))


def marked(root: Path) -> int:
    """Samples dead.json marks evicted in segments that still exist."""
    if not (root / DEAD).is_file():
        return 0
    dead = json.loads((root / DEAD).read_text())["dead"]
    return sum(len(v) for k, v in dead.items() if (root / k).is_file())


def check_files(root: Path) -> int:
    """Every segment in ``root`` whole and loadable, one generation per segment, no
    temporary file left; returns the samples the files hold."""
    bases, total = set(), 0
    for p in root.iterdir():
        assert not p.name.startswith(".tmp-"), p
        m = NAME_RE.match(p.name)
        if m is None:
            assert p.name in ("spool.json", "spool.lock", DEAD), p
            continue
        assert m.group(1) not in bases, f"two generations of {m.group(1)}"
        bases.add(m.group(1))
        header, offset, _ = read_header(p)
        x = read_samples(p, header.shape, offset)
        assert x.shape == header.shape and np.isfinite(x).all()
        total += header.shape[0]
    return total


# -- quota, caps, age ----------------------------------------------------------------------------


def test_the_quota_holds_under_a_flood_of_single_and_batched_records(tmp_path: Path) -> None:
    quota = 0.25
    spool = Spool(tmp_path / "s", cfg(quota_mb=quota))
    rng = np.random.default_rng(0)
    stored = 0
    for i in range(400):
        n = int(rng.choice([1, 1, 1, 7, 32]))
        stored += spool.record(rng.random((n, 3, 8, 8), dtype=np.float32),
                               label=rng.integers(0, 4, n), logits=rng.normal(size=(n, 4)))
        st = spool.stats()
        assert st.bytes_on_disk <= quota * MB, (i, st)
        assert disk_bytes(tmp_path / "s") <= quota * MB, i
    st = spool.stats()
    assert st.recorded == stored and st.evicted["quota"] > 0 and st.dropped["quota"] > 0
    assert st.bytes_on_disk - st.evicted_bytes <= quota * MB * 0.9
    assert st.samples == check_files(tmp_path / "s") - marked(tmp_path / "s")
    spool.close()
    again = Spool(tmp_path / "s", cfg(quota_mb=quota))  # the index rebuilt from the files
    assert again.stats().samples == st.samples and kept_ids(again, tmp_path) is not None


def test_a_smaller_quota_on_open_evicts_down_to_it(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", cfg()) as spool:
        for i in range(30):
            spool.record(sample(i), label=0, logits=two_class(i / 10))
    with Spool(tmp_path / "s", cfg(quota_mb=quota_for(10))) as spool:
        assert spool.stats().samples == 10
        assert kept_ids(spool, tmp_path) == list(range(10))  # the least sure stay


def test_per_class_cap_keeps_each_class_s_least_confident(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", cfg(per_class_cap=5))
    a = list(range(12))
    random.Random(1).shuffle(a)
    for v in a:  # class 0: 12 samples; sample id = how sure the model was
        spool.record(sample(v), label=0, logits=two_class(v / 4))
    for v in (100, 101, 102):
        spool.record(sample(v), label=1, logits=two_class(-5))
    assert kept_ids(spool, tmp_path) == [0, 1, 2, 3, 4, 100, 101, 102]
    st = spool.stats()
    assert st.per_class == {0: 5, 1: 3} and st.evicted["class_cap"] + st.dropped.get(
        "class_cap", 0) == 7


class Clock:
    """Stands in for the time module inside agent.spool.store."""

    def __init__(self, t: float) -> None:
        self.t = t
        self._ns = itertools.count()

    def time(self) -> float:
        return self.t

    def time_ns(self) -> int:
        return int(self.t * 1e9) + next(self._ns)

    def monotonic(self) -> float:
        return self.t


def test_samples_older_than_max_age_go_on_the_next_record_or_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(1_000_000.0)
    monkeypatch.setattr(store_mod, "time", clock)
    spool = Spool(tmp_path / "s", cfg(max_age_s=60))
    spool.record(np.stack([sample(1), sample(2)]), label=0)
    clock.t += 30
    spool.record(sample(3), label=0)
    clock.t += 31  # 1 and 2 are 61 s old, 3 is 31 s old
    spool.record(sample(4), label=1)
    assert kept_ids(spool, tmp_path) == [3, 4] and spool.stats().evicted["age"] == 2
    spool.close()
    clock.t += 45  # 3 is 76 s old: gone when the spool is opened again
    with Spool(tmp_path / "s", cfg(max_age_s=60)) as again:
        assert kept_ids(again, tmp_path) == [4]
    assert len(list((tmp_path / "s").glob("*.seg"))) == 1


# -- which samples stay -------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["margin", "entropy", "none"])
def test_over_quota_the_kept_set_is_the_least_confident(tmp_path: Path, rule: str) -> None:
    """60 one-sample records of known confidence (sample i has logit i/8 for its label) in a
    shuffled order, into a quota of 20: the 20 least sure stay (none: the 20 newest)."""
    spool = Spool(tmp_path / "s", cfg(quota_mb=quota_for(20), hard_example=rule))
    order = list(range(60))
    random.Random(2).shuffle(order)
    for v in order:
        spool.record(sample(v), label=0, logits=two_class(v / 8))
    want = sorted(order[-20:]) if rule == "none" else list(range(20))
    assert kept_ids(spool, tmp_path) == want
    assert spool.stats().samples == 20 and disk_bytes(tmp_path / "s") <= quota_for(20) * MB
    spool.close()
    with Spool(tmp_path / "s", cfg(quota_mb=quota_for(20), hard_example=rule)) as again:
        assert kept_ids(again, tmp_path) == want


def test_margin_keeps_a_confidently_wrong_sample_entropy_does_not(tmp_path: Path) -> None:
    for rule, kept in (("margin", True), ("entropy", False)):
        with Spool(tmp_path / rule, cfg(quota_mb=quota_for(5), hard_example=rule)) as spool:
            spool.record(sample(99), label=1, logits=two_class(6.0))  # sure, and wrong
            for v in range(10):
                spool.record(sample(v), label=0, logits=two_class(0.5 + v / 10))
            assert (99 in kept_ids(spool, tmp_path)) is kept


def test_batched_records_keep_hard_examples_and_compact_evicted_ones(tmp_path: Path) -> None:
    """Batches of 8 RGB 32x32 samples (12 KB each): the hard samples recorded first survive a
    flood of easy ones (evicted out of their segments one by one, then compacted), the kept
    share of the quota stays full, and the kept set survives a reopen."""
    quota, shape = 1.0, (3, 32, 32)
    spool = Spool(tmp_path / "s", cfg(quota_mb=quota))
    hard = np.stack([sample(1000 + i, shape) for i in range(8)])
    spool.record(hard, label=np.zeros(8, np.int64), logits=np.tile(two_class(-1.0), (8, 1)))
    rng = np.random.default_rng(3)
    for b in range(150):
        ids = np.arange(b * 8, b * 8 + 8)
        spool.record(np.stack([sample(i, shape) for i in ids]), label=np.zeros(8, np.int64),
                     logits=np.stack([two_class(a) for a in rng.uniform(0, 5, 8)]))
        assert spool.stats().bytes_on_disk <= quota * MB
    st = spool.stats()
    kept = kept_ids(spool, tmp_path)
    assert set(range(1000, 1008)) <= set(kept) and st.samples == len(kept)
    # Eviction stopped once a batch fitted: the kept share is full to within one batch.
    limit = quota * MB * (1 - store_mod.COMPACT_RESERVE)
    assert limit - 8 * 3 * 32 * 32 * 4 - 2 * BLOCK <= st.bytes_on_disk - st.evicted_bytes
    assert st.compacted > 0 and any(  # evicted samples were compacted away
        p.name.split(".")[1] != "0" for p in (tmp_path / "s").glob("*.seg"))
    spool.close()
    with Spool(tmp_path / "s", cfg(quota_mb=quota)) as again:
        assert kept_ids(again, tmp_path) == kept


def test_pseudo_labels_only_above_the_threshold_and_marked(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", cfg(pseudo_label_threshold=0.9))
    sure = np.array([0.0, 5.0, 0.0])  # p(1) = 0.987
    unsure = np.array([0.0, 1.0, 0.5])  # p(1) = 0.51
    assert spool.record(sample(1), logits=sure) == 1
    assert spool.record(sample(2), logits=unsure) == 0
    assert spool.record(sample(3)) == 0  # no label, no logits: nothing to learn from
    assert spool.record(sample(4), label=2, logits=unsure) == 1  # a real label stays real
    batch = np.stack([sample(5), sample(6)])
    assert spool.record(batch, logits=np.stack([unsure, sure[[1, 0, 2]]])) == 1
    st = spool.stats()
    assert st.samples == 3 and st.pseudo_labelled == 2 and st.dropped["unlabelled"] == 3
    info = spool.snapshot(tmp_path / "snap.npz")
    with np.load(info.path, allow_pickle=False) as z:
        got = {int(x[0, 0, 0]): (int(y), bool(p)) for x, y, p in zip(z["x"], z["y"],
                                                                     z["pseudo"], strict=True)}
    assert got == {1: (1, True), 4: (2, False), 6: (0, True)}
    assert info.pseudo_labelled == 2 and info.per_class == {0: 1, 1: 1, 2: 1}
    without = Spool(tmp_path / "t", cfg())  # no threshold: unlabelled records are dropped
    assert without.record(sample(1), logits=sure) == 0


def test_snapshot_is_an_npz_the_trainer_loads_and_its_hash_names_its_content(
        tmp_path: Path) -> None:
    from hpc_core.data import load_npz_tensors

    spool = Spool(tmp_path / "s", cfg())
    rng = np.random.default_rng(4)
    spool.record(rng.random((10, 1, 8, 8), dtype=np.float32), label=rng.integers(0, 3, 10))
    a, b = spool.snapshot(tmp_path / "a.npz"), spool.snapshot(tmp_path / "b.npz")
    assert a.sha256 == b.sha256 and a.samples == 10
    x, y = load_npz_tensors(a.path, None)
    assert tuple(x.shape) == (10, 1, 8, 8) and len(y) == 10
    spool.record(sample(1), label=0)
    assert spool.snapshot(tmp_path / "c.npz").sha256 != a.sha256


def test_bad_arguments_raise_a_different_shape_or_a_nan_is_dropped(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", cfg())
    for bad in ({"x": np.zeros((8, 8))}, {"x": sample(1), "logits": np.zeros(1)},
                {"x": sample(1), "label": -1}, {"x": sample(1), "label": 1.5},
                {"x": np.zeros((2, 1, 8, 8)), "label": [0, 1, 2]},
                {"x": sample(1), "label": 3, "logits": np.zeros(3)}):
        with pytest.raises(ValueError):
            spool.record(**bad)
    assert spool.record(sample(1), label=0) == 1
    assert spool.record(sample(2, (1, 16, 16)), label=0) == 0
    assert spool.record(sample(np.nan), label=0) == 0
    assert spool.stats().dropped == {"shape": 1, "not_finite": 1}


def test_a_damaged_segment_is_deleted_on_open_the_rest_load(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", cfg()) as spool:
        for i in range(3):
            spool.record(sample(i), label=0)
    victim = sorted((tmp_path / "s").glob("*.seg"))[1]
    data = bytearray(victim.read_bytes())
    data[20] ^= 0xFF  # a flipped byte in the header
    victim.write_bytes(bytes(data))
    (tmp_path / "s" / "0000000000000000001-1-1.0.seg").write_bytes(b"garbage")
    with Spool(tmp_path / "s", cfg()) as spool:
        assert kept_ids(spool, tmp_path) == [0, 2]
    assert check_files(tmp_path / "s") == 2


# -- the disk -----------------------------------------------------------------------------------


def test_a_full_disk_stops_recording_without_raising(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    free_mb = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize / MB
    spool = Spool(tmp_path / "s", cfg(min_free_disk_mb=free_mb + 1e6))
    assert spool.record(np.stack([sample(1), sample(2)]), label=0) == 0
    st = spool.stats()
    assert st.dropped == {"disk_full": 2} and not st.recording and st.samples == 0
    assert not list((tmp_path / "s").glob("*.seg"))

    def no_space(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    ok = Spool(tmp_path / "t", cfg())
    assert ok.record(sample(1), label=0) == 1
    monkeypatch.setattr(store_mod, "write_bytes_atomic", no_space)
    assert ok.record(sample(2), label=0) == 0  # ENOSPC mid-write: counted, not raised
    assert ok.stats().dropped == {"error": 1} and ok.stats().samples == 1
    monkeypatch.undo()
    assert ok.record(sample(3), label=0) == 1 and ok.stats().recording


# -- crashes and concurrency -------------------------------------------------------------------

RECORDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from agent.spool.config import SpoolConfig
    from agent.spool.store import Spool
    root, quota, batch, seed, label, count, go, size = sys.argv[1:9]
    batch, count, size = int(batch), int(count), int(size)
    spool = Spool(Path(root), SpoolConfig(quota_mb=float(quota), min_free_disk_mb=0))
    while go != "-" and not Path(go).exists():
        time.sleep(0.001)
    rng = np.random.default_rng(int(seed))
    done = 0
    for i in range(count):
        y = rng.integers(0, 3, batch) if label == "-" else np.full(batch, int(label))
        done += spool.record(rng.random((batch, 3, size, size), dtype=np.float32), label=y,
                             logits=rng.normal(size=(batch, 3)))
        print(done, flush=True)
""")


def recorder(root: Path, *, quota: float, batch: int, seed: int, label: str = "-",
             count: int = 10**9, go: str = "-", size: int = 32) -> subprocess.Popen[str]:
    """A process recording ``count`` batches of RGB size x size samples into ``root`` (once
    ``go`` exists), printing how many it stored so far after each."""
    return subprocess.Popen(
        [sys.executable, "-c", RECORDER, str(root), str(quota), str(batch), str(seed), label,
         str(count), go, str(size)], cwd=REPO, stdout=subprocess.PIPE, text=True)


# no-eviction: a quota ten rounds cannot fill. At 64 MB a host that records ~460 samples a
# round (12 KiB each) reached the quota in round 8 and evicted what the check counts on.
@pytest.mark.parametrize("quota", [1024.0, 0.5], ids=["no-eviction", "evicting"])
def test_kill_9_mid_write_loses_nothing_committed_and_leaves_no_half_sample(
        tmp_path: Path, quota: float) -> None:
    """A recorder killed at random points, 10 times: reopened, every file is whole and
    loads, the rebuilt index counts what the files hold, and (no eviction) every record that
    returned is there."""
    root, rng, batch = tmp_path / "s", random.Random(5), 5
    before = 0
    for round_ in range(10):
        p = recorder(root, quota=quota, batch=batch, seed=round_)
        assert p.stdout is not None
        p.stdout.readline()  # recording has started
        time.sleep(rng.uniform(0.0, 0.15))
        p.send_signal(signal.SIGKILL)
        lines = p.stdout.read().split()
        p.wait()
        committed = int(lines[-1]) if lines else batch
        with Spool(root, cfg(quota_mb=quota)) as spool:
            st = spool.stats()
            info = spool.snapshot(tmp_path / "all.npz")  # reads every kept sample
        assert info.samples == st.samples
        assert check_files(root) - marked(root) == st.samples
        assert st.bytes_on_disk <= quota * MB
        if quota == 1024.0:
            assert before + committed <= st.samples <= before + committed + batch, round_
        before = st.samples


def test_two_processes_recording_at_once(tmp_path: Path) -> None:
    """Two pairs of processes, started together: one pair into a roomy spool (nothing lost,
    each one's samples all there), one into a small one (the quota holds)."""
    go = tmp_path / "go"
    procs = [recorder(tmp_path / "s", quota=64.0, batch=1, seed=i, label=str(i), count=150,
                      go=str(go), size=8) for i in range(2)]
    procs += [recorder(tmp_path / "q", quota=0.5, batch=3, seed=i + 2, count=100,
                       go=str(go)) for i in range(2)]
    time.sleep(1.0)  # both have opened their spool
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0
    with Spool(tmp_path / "s", cfg()) as spool:
        assert spool.stats().per_class == {0: 150, 1: 150}
    assert check_files(tmp_path / "s") == 300
    with Spool(tmp_path / "q", cfg(quota_mb=0.5)) as spool:
        st = spool.stats()
        assert st.bytes_on_disk <= 0.5 * MB and disk_bytes(tmp_path / "q") <= 0.5 * MB
        assert spool.snapshot(tmp_path / "q.npz").samples == st.samples > 0


def test_threads_recording_at_once(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", cfg())
    stored: list[int] = []

    def work(k: int) -> None:
        stored.append(sum(spool.record(sample(k * 1000 + i), label=k) for i in range(50)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stored == [50] * 4
    assert spool.stats().per_class == {0: 50, 1: 50, 2: 50, 3: 50}
    assert len(set(kept_ids(spool, tmp_path))) == 200
