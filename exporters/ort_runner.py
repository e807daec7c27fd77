"""The one way the project builds an ONNX Runtime session, and a runner around it.

Gates, layer sensitivity, the device's health check, the benchmarks and the serving runtime
all score models through :func:`ort_session`, so a number measured in one place is the number
the others see. Torch-free: the device's runtime and health check load it without torch.

Every session asks for ONNX Runtime's precise x64 INT8 kernels
(``session.x64quantprecision=1``). Without it, ONNX Runtime fuses Q/DQ pairs into integer
convolutions whose u8 x s8 kernel, on x86 without VNNI (AVX2 and AVX-512 without VNNI),
adds pairs of products in a saturating 16-bit lane: a symmetric-int8 small_cnn scored 13 %
instead of 98 % on such a host while every structural check passed. The option makes ONNX
Runtime rewrite s8 weights to u8 and use its u8 x u8 kernel where the fast one could
overflow; weights in [-64, 64] (the ``u8s8-reduce-range`` recipe) cannot overflow, so they
keep the fast kernel. INT8 results then no longer depend on the CPU's instruction set. The
price is not zero on every host: on an AVX-512 VNNI host the option rewrote the symmetric
s8 x s8 weights too, a small_cnn at batch 1 going from 1.66 to 1.96 ms (the
``u8s8-reduce-range`` model of the same net: 0.82 ms), so which recipe is fastest on VNNI
wants measuring there (``python benchmarks/export.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from exporters.detection.outputs import OUTPUT_NAMES, pack

PRECISE_INT8 = ("session.x64quantprecision", "1")
NO_SPINNING = ("session.intra_op.allow_spinning", "0")
"""ONNX Runtime's intra-op threads spin between runs by default, waiting for the next one:
a session serving 20 requests/s kept a core 79 % busy doing nothing (python
benchmarks/ort_spin.py). The serving runtime turns it off (:class:`agent.runtime.ActiveModel`):
on a device that core belongs to the fine-tune and the board's heat budget."""


def ort_session(
    path: Path,
    *,
    threads: int = 0,
    providers: Sequence[str | tuple[str, dict[str, str]]] | None = None,
    optimize: bool = True,
    spin: bool = True,
) -> ort.InferenceSession:
    """A session on ``path``; ``threads`` 0 = ONNX Runtime's default (all cores).

    ``optimize=False`` turns graph optimization off: Q/DQ then stays unfused and every
    operator runs in float, the reference the fused INT8 kernels are checked against.
    ``spin=False`` lets the intra-op threads sleep between runs (:data:`NO_SPINNING`): for
    sessions that wait on requests; work that runs back to back (gates, evaluation) keeps
    ONNX Runtime's default. One thread has no pool, so nothing to spin either way.
    """
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.add_session_config_entry(*PRECISE_INT8)
    if not spin:
        opts.add_session_config_entry(*NO_SPINNING)
    return ort.InferenceSession(str(path), opts,
                                providers=list(providers or ["CPUExecutionProvider"]))


class OrtRunner:
    """Float32 batch in, float32 logits out, through :func:`ort_session`; an exported
    detector's four outputs (``exporters.detection.outputs``) come out packed as one
    ``[N, K, 6]`` array, so that batching, scoring and timing treat both alike."""

    def __init__(
        self,
        path: Path,
        *,
        threads: int = 0,
        providers: list[str] | None = None,
        optimize: bool = True,
        name: str = "onnxruntime",
        spin: bool = True,
    ) -> None:
        self.session = ort_session(path, threads=threads, providers=providers, optimize=optimize,
                                   spin=spin)
        self.input_name = self.session.get_inputs()[0].name
        self.name = name
        names = {o.name for o in self.session.get_outputs()}
        self.detections = set(OUTPUT_NAMES) <= names

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.detections:
            return pack(self.session.run(list(OUTPUT_NAMES), {self.input_name: x}))
        return self.session.run(None, {self.input_name: x})[0]
