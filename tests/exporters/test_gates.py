from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from exporters.gates import GateMeasurement, judge, measure, top1
from exporters.job import GateConfig
from exporters.ort_runner import OrtRunner
from exporters.runtime import Latency, TorchRunner, predict


def _measurement(**kw: Any) -> GateMeasurement:
    base: dict[str, Any] = {
        "top1": 0.97, "reference_top1": 0.98, "top1_drop_pts": 1.0, "max_abs_logit_delta": 0.2,
        "latency_b1": Latency(1, 0.5, 0.9, 50), "latency_batch": Latency(32, 4.0, 6.0, 50),
        "size_mb": 0.1, "samples": 359,
    }
    return GateMeasurement(**{**base, **kw})


def test_top1() -> None:
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert top1(logits, np.array([1, 0, 0])) == pytest.approx(2 / 3)


def test_limits_are_inclusive_and_null_means_not_gated() -> None:
    m = _measurement()
    assert judge(m, GateConfig(max_top1_drop_pts=1.0)).passed
    assert judge(m, GateConfig(max_top1_drop_pts=None, max_abs_logit_delta=None)).passed


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"max_top1_drop_pts": 0.5}, "max_top1_drop_pts"),
        ({"max_abs_logit_delta": 0.1}, "max_abs_logit_delta"),
        ({"max_p50_ms_b1": 0.4}, "max_p50_ms_b1"),
        ({"max_p99_ms_b1": 0.8}, "max_p99_ms_b1"),
        ({"max_p50_ms_batch": 3.0}, "max_p50_ms_batch"),
        ({"max_p99_ms_batch": 5.0}, "max_p99_ms_batch"),
        ({"max_size_mb": 0.05}, "max_size_mb"),
    ],
)
def test_each_failed_gate_names_its_option(limits: dict[str, float], field: str) -> None:
    result = judge(_measurement(), GateConfig(**limits))
    assert not result.passed
    assert len(result.failures) == 1 and f"gates.{field}" in result.failures[0]


def test_gate_config_rejects_unknown_keys_and_negative_limits() -> None:
    with pytest.raises(ValueError, match="extra"):
        GateConfig(max_top1_drop=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        GateConfig(max_top1_drop_pts=-1)


def test_measures_the_exported_file_against_both_references(cnn: Any, cnn_fp32: Any) -> None:
    x, y = cnn.held_out()
    model = cnn.model()
    ref = predict(TorchRunner(model), x)
    cfg = GateConfig(batch_size=8, latency_iters=5, latency_warmup=1)
    # The fidelity reference differs from the accuracy reference after pruning: pretend the
    # exported model had been perturbed by 0.25 to see each used for its own number.
    m = measure(OrtRunner(cnn_fp32.path), inputs=x, labels=y, reference_logits=ref,
                fidelity_logits=ref + 0.25, size_bytes=cnn_fp32.size_bytes, cfg=cfg)
    assert m.top1 == pytest.approx(top1(ref, y)) and m.top1_drop_pts == pytest.approx(0.0)
    assert m.max_abs_logit_delta == pytest.approx(0.25, abs=1e-3)
    assert (m.latency_b1.batch, m.latency_batch.batch) == (1, 8)
    assert 0 < m.latency_b1.p50_ms <= m.latency_b1.p99_ms
    assert m.samples == len(y) and m.size_mb == cnn_fp32.size_bytes / 1e6
    with torch.no_grad():
        assert m.reference_top1 == top1(model(torch.from_numpy(x)).numpy(), y)
