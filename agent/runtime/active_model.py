"""The committed model, served in the application's process; follows commits without a
restart and without failing a request.

    with ActiveModel(Path("/var/lib/edge-agent"), "digits", slo_ms=20) as model:
        logits = model.predict(batch)            # float32 NCHW in, a classifier's logits out
        outputs = model.infer(batch)             # every output by name (a detector's four)
        with model.hold_updates():               # no version change inside this block
            ...

How a new version comes in: a watcher thread polls ``os.readlink`` of
``models/<name>/current`` and the COMPLETE marker of the slot it names (version, sequence,
manifest hash) every ``poll_s``. On a change it loads the new slot (:func:`engine_for`) and
warms it on a zero batch *off the request path*, then flips one reference under a lock.
Requests already running on the old engine finish on it; the old engine is released when
its last request returns. A slot that fails to load is counted and logged, and the old
version keeps serving.

Why poll the symlink and not ask the daemon (its control socket): it works with no daemon
running (a model pulled by hand, a daemon restarting or stopped for maintenance), it needs
no permission on the daemon's socket, and ``commit`` switches ``current`` by one atomic
``rename(2)``, which is exactly what a readlink sees: the old target or the new one, never a
half-written slot. The marker is read too because two commits between two polls can bring
``current`` back to the same slot name holding another version. inotify would save the
polling but is not in the standard library; a readlink and a ~100-byte read every 0.2 s
cost nothing measurable.

Torch-free (the import-linter contract "what the daemon loads stays torch-free").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

import numpy as np

from agent.runtime.engine_outputs import EngineOutputs
from agent.runtime.engines import ServingEngine, engine_for
from agent.runtime.latency import LatencyWindow, percentiles
from agent.runtime.stats import ServingStats, remove_stats, write_stats
from agent.runtime.update_lock import hold_update_lock
from agent.storage.nofollow import read_bytes
from agent.storage.slots import SLOT_NAMES, ModelSlots
from agent.storage.verify import MARKER
from registry.errors import NoActiveModelError, RegistryError
from registry.jsonsafe import loads_strict

log = logging.getLogger("agent.runtime")

WARMUP_RUNS = 3
_F32 = np.dtype(np.float32)  # numpy's native dtypes are singletons: an identity test suffices
LOAD_RETRY_S = 10.0
"""A version that failed to load is tried again after this long (or when another commit
comes): a broken slot must not cost a full load every poll."""


class SampleSpool(Protocol):
    """Where recorded samples go (``agent.spool``'s Spool, or any object with this method)."""

    def record(self, x: np.ndarray, *, label: int | None = None,
               logits: np.ndarray | None = None) -> int: ...


class NoSpoolError(RuntimeError):
    """record() on a model served without a spool."""


SlotKey = tuple[str, str, int, str]
"""(slot, version, sequence, manifest sha256): what the watcher compares."""


@dataclass(eq=False)
class _Loaded:
    engine: ServingEngine
    version: str
    key: SlotKey
    inflight: int = 0
    retired: bool = False
    sample_shape: tuple[int, ...] | None = field(init=False)
    """The input's shape past the batch, when every one of those dimensions is fixed."""

    def __post_init__(self) -> None:
        tail = self.engine.input_shape[1:]
        self.sample_shape = None if any(d < 0 for d in tail) else tail


@dataclass
class _Counters:
    requests: int = 0
    failed: int = 0
    swaps: int = 0
    load_failures: int = 0
    deferred_key: SlotKey | None = None
    last_error: str | None = None
    failed_key: SlotKey | None = None
    retry_at: float = 0.0
    latencies: LatencyWindow = field(default_factory=LatencyWindow)


class ActiveModel:
    """``name``'s committed version in ``state_dir``, served from this process.

    ``providers``/``threads`` go to ONNX Runtime (None: the best provider it has; 0 threads:
    its default); its threads sleep between requests unless ``spin`` (the lowest latency on
    cores nothing else needs, for a core kept busy). ``slo_ms`` is the application's p99
    objective, written into its stats for the governor. ``spool`` (any object with
    ``record(x, *, label, logits) -> int``) takes the samples :meth:`record` is given. With no
    committed model yet, :meth:`predict` raises NoActiveModelError; :meth:`wait_ready` waits
    for the first commit.
    """

    def __init__(self, state_dir: Path, name: str, *, providers: list[str] | None = None,
                 threads: int = 0, spin: bool = False, slo_ms: float | None = None,
                 poll_s: float = 0.2,
                 spool: SampleSpool | None = None, stats_interval_s: float = 1.0,
                 stats_window_s: float = 10.0) -> None:
        if slo_ms is not None and slo_ms <= 0:
            raise ValueError(f"slo_ms={slo_ms}: a latency objective is a positive number of ms")
        self.state_dir, self.name = Path(state_dir), name
        self.providers, self.threads, self.spin, self.slo_ms = providers, threads, spin, slo_ms
        self.poll_s, self.spool = poll_s, spool
        self.stats_interval_s, self.stats_window_s = stats_interval_s, stats_window_s
        self._slots = ModelSlots(self.state_dir, name)
        self._lock = threading.Lock()
        self._current: _Loaded | None = None
        self._holds = 0
        self._c = _Counters()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._stats_warned = False
        self._poll()  # the version committed now serves from the first predict
        self._threads = [threading.Thread(target=self._loop, args=(self._poll, poll_s),
                                          name=f"active-model-{name}-watch", daemon=True),
                         threading.Thread(target=self._loop,
                                          args=(self._write_stats, stats_interval_s),
                                          name=f"active-model-{name}-stats", daemon=True)]
        for t in self._threads:
            t.start()

    # -- the request path

    def predict(self, batch: np.ndarray) -> np.ndarray:
        """Logits of a float32 NCHW batch (a one-output model's output), from the version
        active when the call began; a TypeError for a model of several outputs (a
        detector): :meth:`infer` answers those."""
        return self.predict_versioned(batch)[0]

    def predict_versioned(self, batch: np.ndarray) -> tuple[np.ndarray, str]:
        """:meth:`predict`, and the version that answered (a swap may land between a call
        and a later look at :attr:`version`)."""
        outputs, version = self.infer_versioned(batch)
        return outputs.sole(), version

    def infer(self, batch: np.ndarray) -> EngineOutputs:
        """Every output of a float32 NCHW batch by name, in the model's order (a classifier's
        logits; a detector's num_detections, boxes, scores, classes)."""
        return self.infer_versioned(batch)[0]

    def infer_versioned(self, batch: np.ndarray) -> tuple[EngineOutputs, str]:
        """:meth:`infer`, and the version that answered: every output of one run comes
        from that one version, whatever commit lands meanwhile."""
        with self._lock:
            loaded = self._current
            if loaded is None:
                self._c.requests += 1
                self._c.failed += 1
                raise self._not_ready()
            loaded.inflight += 1
        t0 = time.perf_counter()
        ok = False
        try:
            # The common case in three comparisons; the full check only to say what is wrong.
            if not (type(batch) is np.ndarray and batch.dtype is _F32
                    and batch.shape[1:] == loaded.sample_shape):
                _check_input(batch, loaded.engine.input_shape)
            out = loaded.engine(batch)
            ok = True
            return out, loaded.version
        finally:
            t1 = time.perf_counter()
            with self._lock:
                loaded.inflight -= 1
                release = loaded.retired and loaded.inflight == 0
                self._c.requests += 1
                if ok:
                    self._c.latencies.add((t1 - t0) * 1e3, t1)
                else:
                    self._c.failed += 1
            if release:
                loaded.engine.close()

    def record(self, x: np.ndarray, label: int | None = None) -> int:
        """Score ``x`` and hand it, its logits and ``label`` to the spool; returns what the
        spool says it holds. A model of several outputs (a detector) has no logits: its
        samples go without them (no confidence, no argmax pseudo-label: kept as the spool
        keeps an unscored sample), with ``label`` when given."""
        if self.spool is None:
            raise NoSpoolError(f"{self.name}: no spool configured: pass spool= to ActiveModel")
        outputs = self.infer(x)
        logits = outputs.sole() if len(outputs) == 1 else None
        return self.spool.record(x, label=label, logits=logits)

    # -- state

    @property
    def version(self) -> str | None:
        cur = self._current
        return cur.version if cur is not None else None

    @property
    def engine(self) -> ServingEngine | None:
        """The engine serving now (its shapes, platform, providers), or None."""
        cur = self._current
        return cur.engine if cur is not None else None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once a version serves (False when ``timeout`` seconds passed first)."""
        return self._ready.wait(timeout)

    @contextlib.contextmanager
    def hold_updates(self) -> Iterator[None]:
        """No new version serves in this process inside the block, and the device job's
        commit waits for it (up to the device's ``limits.update_lock_max_wait_s``)."""
        with self._lock:
            self._holds += 1
        try:
            with hold_update_lock(self.state_dir, self.name):
                yield
        finally:
            with self._lock:
                self._holds -= 1

    def stats(self) -> ServingStats:
        now = time.time()
        with self._lock:
            recent = self._c.latencies.recent(self.stats_window_s)
            c = self._c
            version, requests, failed, swaps = self.version, c.requests, c.failed, c.swaps
        p50, p99, n = percentiles(recent)
        return ServingStats(
            model=self.name, version=version, pid=os.getpid(), updated=now,
            window_s=self.stats_window_s, window_requests=n, p50_ms=p50, p99_ms=p99,
            requests=requests, failed=failed, swaps=swaps, slo_ms=self.slo_ms)

    @property
    def load_failures(self) -> int:
        """Versions that failed to load (the previous one kept serving)."""
        return self._c.load_failures

    @property
    def last_error(self) -> str | None:
        return self._c.last_error

    def close(self) -> None:
        """Stop following commits; the engine is released when its last request returns."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        with self._lock:
            cur, self._current = self._current, None
            release = cur is not None and cur.inflight == 0
            if cur is not None:
                cur.retired = True
        if release:
            cur.engine.close()  # type: ignore[union-attr]
        with contextlib.suppress(OSError):
            remove_stats(self.state_dir, self.name)

    def __enter__(self) -> ActiveModel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- following commits (the watcher thread)

    def _not_ready(self) -> Exception:
        if self._stop.is_set():
            return RuntimeError(f"ActiveModel {self.name!r} is closed")
        why = f" (last load failure: {self._c.last_error})" if self._c.last_error else ""
        return NoActiveModelError(
            f"no committed version of {self.name!r} serves from {self.state_dir} yet{why}: "
            "deploy one (agentctl deploy / pull), or call wait_ready(timeout) first")

    def _loop(self, step: Callable[[], None], every_s: float) -> None:
        said = None
        while not self._stop.wait(every_s):
            try:
                step()
                said = None
            except Exception as e:  # a bad poll must never end the thread that follows commits
                if str(e) != said:  # once per distinct problem, not five times a second
                    log.error("%s: %s: %s", self.name, step.__name__, e)
                    said = str(e)

    def _read_key(self) -> SlotKey | None:
        """What ``current`` names now, or None (no committed model, or a commit under way)."""
        target = self._readlink()
        if target is None:
            return None
        slot = target.removeprefix("slots/")
        if target != f"slots/{slot}" or slot not in SLOT_NAMES:
            raise NoActiveModelError(f"{self._slots.current_link} points at {target!r}, not "
                                     "slots/a or slots/b: not following it")
        marker_path = self._slots.slots_dir / slot / MARKER
        try:
            marker = loads_strict(read_bytes(marker_path, 1 << 16), str(marker_path))
        except (OSError, RegistryError):
            return None  # no COMPLETE marker: not a version to serve (the slot is not whole)
        # The link read again after the marker: were the slot discarded and a version staged
        # into it in between, ``current`` would name the other slot by now. The same slot
        # twice means what the marker says was committed when the second read was made.
        if not isinstance(marker, dict) or self._readlink() != target:
            return None
        seq = marker.get("sequence")
        return (slot, str(marker.get("version")), seq if isinstance(seq, int) else 0,
                str(marker.get("manifest_sha256")))

    def _readlink(self) -> str | None:
        try:
            return os.readlink(self._slots.current_link)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _poll(self) -> None:
        key = self._read_key()
        cur = self._current
        if key is None or (cur is not None and cur.key == key):
            return
        now = time.monotonic()
        if key == self._c.failed_key and now < self._c.retry_at:
            return
        if self._holds:
            self._note_deferred(key)
            return
        slot_path = self._slots.slots_dir / key[0]
        t0 = time.perf_counter()
        engine = None
        try:
            engine = engine_for(slot_path, self.providers, threads=self.threads, spin=self.spin)
            _warm(engine)
        except Exception as e:
            if engine is not None:
                engine.close()
            self._c.load_failures += 1
            self._c.last_error = f"{key[1]}: {e}"
            self._c.failed_key, self._c.retry_at = key, now + LOAD_RETRY_S
            log.warning("%s@%s failed to load; %s keeps serving: %s", self.name, key[1],
                        cur.version if cur else "nothing", e,
                        extra={"fields": {"event": "load_failed", "model": self.name,
                                          "version": key[1], "error": str(e)}})
            return
        if self._read_key() != key:  # committed again while loading: load that one next
            engine.close()
            return
        self._flip(_Loaded(engine, key[1], key), time.perf_counter() - t0)

    def _flip(self, new: _Loaded, load_s: float) -> None:
        with self._lock:
            # Held (or closed) while it loaded: drop it; the next poll after the hold loads
            # whatever is committed then.
            held = bool(self._holds) or self._stop.is_set()
            old = self._current
            if not held:
                self._current = new
                if old is not None:
                    old.retired = True
                    self._c.swaps += 1
                self._c.last_error = None
            # Decided under the lock, so exactly one of this and predict() closes the old
            # engine: no request can pick it up once ``_current`` moved on.
            release_old = not held and old is not None and old.inflight == 0
        if held:
            new.engine.close()
            self._note_deferred(new.key)
            return
        if release_old:
            old.engine.close()  # type: ignore[union-attr]
        self._ready.set()
        e = new.engine
        log.info("%s@%s serving (%s on %s, loaded and warmed in %.2fs)%s", self.name,
                 new.version, e.name, ", ".join(e.providers), load_s,
                 f"; {'; '.join(e.notes)}" if e.notes else "",
                 extra={"fields": {"event": "swap", "model": self.name, "version": new.version,
                                   "previous": old.version if old else None, "runtime": e.name,
                                   "load_s": round(load_s, 3)}})

    def _note_deferred(self, key: SlotKey) -> None:
        if key != self._c.deferred_key:
            self._c.deferred_key = key
            log.info("%s@%s is committed; held by hold_updates(): %s keeps serving until the "
                     "hold ends", self.name, key[1], self.version,
                     extra={"fields": {"event": "update_deferred", "model": self.name,
                                       "version": key[1]}})

    def _write_stats(self) -> None:
        try:
            write_stats(self.state_dir, self.stats())
        except OSError as e:  # serving must not stop because telemetry cannot be written
            if not self._stats_warned:
                log.warning("%s: cannot write serving stats: %s", self.name, e)
                self._stats_warned = True


def _check_input(x: np.ndarray, shape: tuple[int, ...]) -> None:
    """Refuse, with the reason, what the runtime would refuse with a less readable one."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError(f"input must be a float32 numpy array, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != len(shape) or any(w not in (-1, g) for w, g in zip(shape, x.shape, strict=True)):
        want = "x".join("N" if d == -1 else str(d) for d in shape)
        raise ValueError(f"input shape {list(x.shape)} does not fit the model's {want}")


def _warm(engine: ServingEngine) -> None:
    # The first runs allocate arenas and pick kernels: done here, off the request path.
    sample = engine.input_shape[1:]
    if any(d < 0 for d in sample):
        return
    x = np.zeros((1, *sample), dtype=np.float32)
    for _ in range(WARMUP_RUNS):
        engine(x)
