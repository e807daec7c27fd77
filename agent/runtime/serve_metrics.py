"""What ``agentctl serve`` has answered, for Prometheus: ``GET /metrics`` on its HTTP port.

The inference counters carry Triton Inference Server's names and labels
(``{model, version}``; a failure also ``reason``), so a Grafana dashboard or alert written for
Triton reads an edgetrain device unchanged:

=========================================  =================================================
``nv_inference_request_success``           requests answered (HTTP and gRPC)
``nv_inference_request_failure``           requests refused or failed; ``reason`` REJECTED
                                           (a bad request, no version serving) or BACKEND
                                           (the model or the server failed)
``nv_inference_count``                     inferences: a request of batch N counts N
``nv_inference_exec_count``                model executions (one per request: no batcher)
``nv_inference_request_duration_us``       cumulative request time, parse to encoded answer
``nv_inference_compute_infer_duration_us`` cumulative time inside the model
=========================================  =================================================

Triton types these as counters without the ``_total`` suffix that ``prometheus_client``
(and OpenMetrics) write for a counter; so that the names stay Triton's, they are exposed
untyped, which ``rate()`` and ``increase()`` read as they read a counter. Beside them, a
histogram of the request time, ``edgetrain_inference_request_duration_seconds``, for
``histogram_quantile()`` (Triton's own latency figures are cumulative sums only).

One :class:`ServeMetrics` per serving process, shared by its HTTP and gRPC servers; its own
registry, not the library's global one, so two servers in one process (the tests) never mix.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.runtime.active_model import ActiveModel
from agent.runtime.engine_outputs import EngineOutputs
from registry.errors import NoActiveModelError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The text format ``generate_latest`` writes (Prometheus' 0.0.4; newer clients also name it
``CONTENT_TYPE_PLAIN_0_0_4``, older ones do not)."""

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5)
"""From a small classifier's 0.1 ms to a detector's frame beside a fine-tune."""


@dataclass
class _Counts:
    success: int = 0
    inferences: int = 0
    execs: int = 0
    request_us: float = 0.0
    compute_us: float = 0.0


@dataclass
class Inference:
    """One request being answered: the serving side fills in what it learns."""

    t0: float = field(default_factory=time.perf_counter)
    version: str | None = None
    batch: int = 0
    compute_s: float = 0.0

    def infer(self, model: ActiveModel, x: np.ndarray) -> tuple[EngineOutputs, str]:
        """``model.infer_versioned(x)``, its time, batch and version counted for this
        request."""
        t0 = time.perf_counter()
        outputs, self.version = model.infer_versioned(x)
        self.compute_s, self.batch = time.perf_counter() - t0, len(x)
        return outputs, self.version


class ServeMetrics(Collector):
    """The counters of one serving process (model ``model``), and their exposition."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._counts: dict[str, _Counts] = {}
        self._failures: Counter[tuple[str, str]] = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._latency = Histogram(
            "edgetrain_inference_request_duration_seconds",
            "Request time, parse to encoded answer, of answered inference requests",
            ["model", "version"], buckets=LATENCY_BUCKETS_S, registry=self.registry)

    @contextmanager
    def request(self, serving_version: str | None) -> Iterator[Inference]:
        """Count one inference request: answered when the block ends normally (the model
        run through :meth:`Inference.infer`), failed (its reason from the exception) when it
        raises."""
        inf = Inference()
        try:
            yield inf
        except Exception as e:
            reason = ("REJECTED" if isinstance(e, (ValueError, NoActiveModelError))
                      or getattr(e, "status", 500) < 500 else "BACKEND")
            with self._lock:
                self._failures[(inf.version or serving_version or "", reason)] += 1
            raise
        seconds = time.perf_counter() - inf.t0
        version = inf.version or serving_version or ""
        with self._lock:
            c = self._counts.setdefault(version, _Counts())
            c.success += 1
            c.inferences += inf.batch
            c.execs += 1
            c.request_us += seconds * 1e6
            c.compute_us += inf.compute_s * 1e6
        self._latency.labels(self.model, version).observe(seconds)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = {v: _Counts(**vars(c)) for v, c in self._counts.items()}
            failures = dict(self._failures)
        families = {
            "nv_inference_request_success": ("Number of successful inference requests",
                                             lambda c: c.success),
            "nv_inference_count": ("Number of inferences performed (a batch of N counts N)",
                                   lambda c: c.inferences),
            "nv_inference_exec_count": ("Number of model executions performed",
                                        lambda c: c.execs),
            "nv_inference_request_duration_us": ("Cumulative inference request duration in "
                                                 "microseconds", lambda c: c.request_us),
            "nv_inference_compute_infer_duration_us": ("Cumulative compute inference duration "
                                                       "in microseconds",
                                                       lambda c: c.compute_us),
        }
        for name, (doc, value) in families.items():
            m = Metric(name, doc, "unknown")
            for version, c in sorted(counts.items()):
                m.add_sample(name, {"model": self.model, "version": version}, value(c))
            yield m
        m = Metric("nv_inference_request_failure", "Number of failed inference requests",
                   "unknown")
        for (version, reason), n in sorted(failures.items()):
            m.add_sample("nv_inference_request_failure",
                         {"model": self.model, "version": version, "reason": reason}, n)
        yield m

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric (``GET /metrics``)."""
        return generate_latest(self.registry)
