"""Every update is verified as a device verifies a pull; what fails is skipped with its
reason, never combined, and too few usable updates write nothing."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pytest

from hpc_core.aggregation import combine
from hpc_core.aggregation.blobs import ChunkChangedError, local_blob
from hpc_core.aggregation.deltas import verify_release
from hpc_core.aggregation.select import listed_versions
from registry.errors import UsageError
from registry.model_config import ModelConfig
from registry.stores import HttpStore
from registry.transfer import TransferConfig
from tests.hpc_core.aggregation.conftest import Result, hand_deltas
from tests.support.fleet_registry import SPEC, FleetRegistry
from tests.support.registry_server import RegistryServer

ZERO = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}
GOOD = hand_deltas()[:4]


def _tensors(delta: dict) -> dict:
    return {k: ZERO[k] + delta[k] for k in ZERO}


def _bad_updates(fleet: FleetRegistry, base) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """One update per refusal; returns version -> the words its reason must hold."""
    step = _tensors(GOOD[0])
    tampered = fleet.update(fleet.device("tampered"), base, {"w": step["w"] * 3, "b": step["b"]})
    chunk = fleet.chunk_path(tampered, "w")
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    rogue = fleet.update(fleet.device("rogue", trusted=False), base, step)
    scoped = fleet.update(fleet.device("jetson-09", scope=f"{fleet.name}@*+jetson-10.*"),
                          base, step, version=f"1+jetson-09.{base.sequence}")
    shape = fleet.update(fleet.device("reshaped"), base,
                         {"w": np.zeros((3, 2), np.float32), "b": step["b"]})
    other = ModelConfig(**{**SPEC.model_dump(), "kwargs": {"hidden": [16]}})
    spec = fleet.update(fleet.device("other-spec"), base, step, spec=other)
    chained = fleet.update(fleet.device("chained"), base, step,
                           parent=fleet.update(fleet.device("chained"), base, step))
    return {
        tampered.version: "ChunkHashError",
        rogue.version: "UnknownKeyError",
        scoped.version: "KeyScopeError",
        shape.version: "tensor w is F32[3, 2], the base's F32[2, 3]",
        spec.version: "model spec",
        chained.version: "a fine-tune of a fine-tune",
    }


def test_each_unverifiable_or_mismatched_update_is_skipped_with_its_reason(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    good = fleet.fine_tunes(base, ZERO, GOOD)
    bad = _bad_updates(fleet, base)
    result = aggregate("--strategy", "fedavg")
    assert result.code == 0, result.stderr
    report = result.report
    # The chained fine-tune's parent (a direct fine-tune of 1) is itself a good update.
    chained_parent = sorted(set(report["combined"]) - {g.version for g in good})
    assert len(chained_parent) == 1 and chained_parent[0].startswith("1+chained.")
    skipped = result.skipped()
    assert set(skipped) == set(bad)
    for version, words in bad.items():
        assert words in skipped[version], (version, skipped[version])
    assert report["ignored"] == {}
    # Only the good ones were averaged: the mean of the four hand deltas and the chain's step.
    steps = [d["w"] for d in GOOD] + [GOOD[0]["w"]]
    np.testing.assert_allclose(result.tensors["w"], np.mean(steps, axis=0), rtol=1e-6)
    for version in bad:
        assert version in result.stdout  # the summary names each skip too


def test_too_few_usable_updates_exit_1_naming_every_reason(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    fleet.fine_tunes(base, ZERO, GOOD[:1])
    bad = _bad_updates(fleet, base)
    # Three pass the manifest checks (the good one, the chain's parent, the tampered one);
    # hashing the chunks leaves two.
    result = aggregate("--min-updates", "3")
    assert result.code == 1
    assert "2 usable update(s) of digits@1, 3 needed" in result.stderr
    assert "nothing written" in result.stderr
    for version in bad:
        assert version in result.stderr
    assert not result.out.exists()
    assert not [p for p in result.out.parent.iterdir() if p.name.startswith(".tmp-")]
    # Krum needs N >= 2f + 3 whatever --min-updates says.
    fleet.fine_tunes(base, ZERO, GOOD[1:], prefix="more")
    assert aggregate("--strategy", "krum", "--krum-f", "1").code == 0  # 5 >= 5
    result = aggregate("--strategy", "krum", "--krum-f", "2")
    assert result.code == 1 and "7 needed" in result.stderr
    # Multi-Krum keeps at most N - f: keeping 5 of 5 with f = 1 needs 6.
    assert aggregate("--strategy", "krum", "--krum-f", "1", "--krum-keep", "4").code == 0
    result = aggregate("--strategy", "krum", "--krum-f", "1", "--krum-keep", "5")
    assert result.code == 1 and "6 needed" in result.stderr


def test_an_explicit_list_skips_what_it_names_but_cannot_use(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    good = fleet.fine_tunes(base, ZERO, GOOD)
    two = fleet.release("2", ZERO, parent=base)
    names = [good[0].version, good[2].version, "1+ghost.20261126T000000Z.9", two.version]
    result = aggregate("--updates", ",".join(names))
    assert result.code == 0, result.stderr
    assert result.report["combined"] == [good[0].version, good[2].version]
    skipped = result.skipped()
    assert "no such version" in skipped["1+ghost.20261126T000000Z.9"]
    assert "upstream release" in skipped["2"]


def test_the_base_must_be_a_verified_upstream_release(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    good = fleet.fine_tunes(base, ZERO, GOOD)
    result = aggregate(base=good[0].version)
    assert result.code == 2 and "is a device version" in result.stderr
    result = aggregate(base="7")
    assert result.code == 2 and "no such version" in result.stderr


def test_over_http_updates_are_named_and_fetched_into_a_private_cache(
        fleet: FleetRegistry, aggregate: Callable[..., Result]) -> None:
    base = fleet.release("1", ZERO)
    good = fleet.fine_tunes(base, ZERO, GOOD)
    with RegistryServer(fleet.root) as server:
        result = aggregate("--strategy", "median", registry=server.url)
        assert result.code == 2 and "--updates V1,V2" in result.stderr
        result = aggregate("--strategy", "median", "--updates",
                           ",".join(g.version for g in good), registry=server.url)
    assert result.code == 0, result.stderr
    np.testing.assert_allclose(result.tensors["w"], np.median([d["w"] for d in GOOD], axis=0))
    assert not [p for p in result.out.parent.iterdir() if p.name.startswith(".aggregate-")]


def test_only_a_folder_store_lists_versions(fleet: FleetRegistry) -> None:
    base = fleet.release("1", ZERO)
    good = fleet.fine_tunes(base, ZERO, GOOD[:2])
    assert fleet.store.list_versions(fleet.name) == sorted(["1", *(g.version for g in good)])
    assert fleet.store.list_versions("unknown-model") == []
    with pytest.raises(UsageError, match="only a folder registry"):
        listed_versions(HttpStore("http://127.0.0.1:9/registry"), fleet.name)


@pytest.mark.parametrize("how", ["swapped", "rewritten in place"])
def test_a_chunk_changed_after_it_was_verified_stops_the_read(
    fleet: FleetRegistry, how: str
) -> None:
    base = fleet.release("1", ZERO)
    up = fleet.update(fleet.device("edge-1"), base, _tensors(GOOD[0]))
    blob = local_blob(fleet.store, up, None, TransferConfig(), {})
    verify_release(blob)
    w = next(t for t in up.tensors if t.name == "w")
    out = np.empty(w.nbytes, np.uint8)
    blob.read_into(out, w.offset)  # verified: read (and the chunk file kept open)
    assert out.view(np.float32).tolist() == [1, 2, 3, 4, 5, 6]
    chunk = fleet.chunk_path(up, "w")
    data = chunk.read_bytes()
    if how == "swapped":  # a new file renamed over it: the open file is not the path's
        chunk.with_suffix(".new").write_bytes(data)
        os.replace(chunk.with_suffix(".new"), chunk)
    else:
        st = chunk.stat()
        chunk.write_bytes(data)
        os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(ChunkChangedError, match="changed after it was verified"):
        blob.read_into(out, w.offset)
    blob.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_updates_measured_in_parallel_keep_their_order_norms_and_skips(
        fleet: FleetRegistry, aggregate: Callable[..., Result],
        monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Several threads hash and measure the updates (reading the shared base under its lock):
    the report is the one-at-a-time report, in the same order, skips included."""
    base = fleet.release("1", ZERO)
    good = fleet.fine_tunes(base, ZERO, GOOD)
    bad = _bad_updates(fleet, base)
    nan = fleet.update(fleet.device("nan"), base,
                       {"w": np.full((2, 3), np.nan, np.float32), "b": ZERO["b"]})
    more = fleet.fine_tunes(base, ZERO, GOOD[::-1], prefix="more")
    monkeypatch.setattr(combine, "MEASURE_THREADS", 1)
    serial = aggregate("--strategy", "median").report
    monkeypatch.setattr(combine, "MEASURE_THREADS", threads)
    result = aggregate("--strategy", "median")
    assert result.code == 0, result.stderr
    report = result.report
    assert report["updates"] == serial["updates"]
    assert report["skipped"] == serial["skipped"]
    assert report["combined"] == serial["combined"]
    assert {g.version for g in good + more} <= set(report["combined"])
    assert "NaN" in result.skipped()[nan.version]
    assert set(result.skipped()) == {*bad, nan.version}
    norms = {row["version"]: row["norm"] for row in report["updates"]}
    for g, d in zip(good, GOOD, strict=True):  # each read against the shared base
        expected = np.sqrt(sum(float((d[k].astype(np.float64) ** 2).sum()) for k in d))
        assert norms[g.version] == pytest.approx(expected, rel=1e-5)


def test_a_shared_release_read_from_many_threads_reads_what_it_holds(
        fleet: FleetRegistry) -> None:
    """The measuring threads all read the base: its one open chunk file is switched and read
    under a lock, so reads across chunk boundaries from several threads never mix files."""
    big = {"w": np.arange(48_000, dtype=np.float32).reshape(400, 120)}  # ~12 chunks of 16 KB
    base = fleet.release("1", big)
    blob = local_blob(fleet.store, base, None, TransferConfig(), {})
    verify_release(blob)
    w = next(t for t in base.tensors if t.name == "w")
    flat = big["w"].ravel()
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            lo = int(rng.integers(0, flat.size - 6_000))
            n = int(rng.integers(1, 6_000))  # up to ~1.5 chunks: crosses boundaries
            out = np.empty(4 * n, np.uint8)
            blob.read_into(out, w.offset + 4 * lo)
            if not np.array_equal(out.view(np.float32), flat[lo:lo + n]):
                errors.append(f"thread {seed}: [{lo}, {lo + n}) read wrong bytes")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    blob.close()
    assert errors == []
