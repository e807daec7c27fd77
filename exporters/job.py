"""The export job and its sections: what ``agentctl export``, ``python -m exporters`` and the
agent's device jobs validate, and what ``exporters.pipeline`` runs.

Torch-free on purpose (pydantic and hpc_core's config only): the daemon checks a job's
export sections, and ``agentctl`` derives its flags from these models, without loading torch,
ONNX or ONNX Runtime. The modules that do the work import their section from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpc_core.config import DataConfig
from hpc_core.job_args import flag

EXPORTED_TASKS = ("classification", "detection")
"""The tasks whose models this exporter takes (``exporters.prepare.FORMS``): a classifier's
logits, a detector's (torchvision SSD/SSDlite) padded detections with NMS in the graph
(``exporters.detection.outputs``). Within a task, a model the export cannot take (another
detector family) is refused when it is loaded, with what to do instead."""


EXPORTED_DETECTORS = ("ssd",)
"""The torchvision detector families exported (``torchvision/ssdlite320_mobilenet_v3_large``,
``torchvision/ssd300_vgg16``): their head is one convolution per feature map over fixed
anchors, which ``exporters.detection.core`` cuts from its post-processing. FCOS and RetinaNet
are not exported yet."""

NO_EXPORT_FIX = ("run the job with steps.export: false (--no-export), and it stages and "
                 "serves the PyTorch checkpoint")


def unexportable(task: str, model: str | None = None) -> str | None:
    """Why a model of ``task`` (built by the name ``model``, when known) cannot be exported
    here, with what to do instead; None when it can. Torch-free: a model built by a factory
    of its own is checked again when it is loaded."""
    if task not in EXPORTED_TASKS:
        return (f"a {task} model has no ONNX export yet (the exporter takes "
                f"{', '.join(EXPORTED_TASKS)} models): {NO_EXPORT_FIX}")
    source, _, name = (model or "").partition("/")
    if task == "detection" and source == "torchvision" and not name.startswith(
            EXPORTED_DETECTORS):
        return (f"a detection model {model} has no ONNX export yet (the exporter takes "
                f"torchvision's SSD and SSDlite detectors): {NO_EXPORT_FIX}")
    return None


Precision = Literal["int8", "fp16", "fp32"]
PruneMethod = Literal["unstructured", "semi_structured", "channels"]
CalibMethod = Literal["minmax", "percentile", "entropy"]

PRUNE_FORMS = "2:4 | unstructured:AMOUNT[:global|:layer] | channels:AMOUNT (AMOUNT in (0, 1))"


class PruneSpec(BaseModel):
    """What to prune. Written on the command line as ``2:4``, ``unstructured:0.5``,
    ``unstructured:0.5:global`` or ``channels:0.5``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: PruneMethod
    """unstructured: smallest |w| anywhere; semi_structured: 2 of every 4 weights along the
    input dimension (sparse tensor cores); channels: whole output channels removed."""
    amount: float = Field(gt=0.0, lt=1.0)
    """Share of weights (unstructured), or of output channels per layer (channels), removed.
    Always 0.5 for 2:4."""
    scope: Literal["layer", "global"] = "layer"
    """unstructured only: the same share in every layer, or one magnitude threshold for all."""

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        return parse_prune_text(data) if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check(self) -> PruneSpec:
        if self.method == "semi_structured" and self.amount != 0.5:
            raise ValueError("semi_structured pruning is 2:4, amount must be 0.5")
        if self.method != "unstructured" and self.scope != "layer":
            raise ValueError("scope=global applies to unstructured pruning only")
        return self

    @property
    def label(self) -> str:
        if self.method == "semi_structured":
            return "2:4"
        suffix = ":global" if self.scope == "global" else ""
        return f"{self.method}:{self.amount:g}{suffix}"


def parse_prune_text(text: str) -> dict[str, Any]:
    """``"unstructured:0.5:global"`` -> the fields of a :class:`PruneSpec`."""
    parts = text.strip().lower().split(":")
    if parts == ["2", "4"]:
        return {"method": "semi_structured", "amount": 0.5}
    if len(parts) in (2, 3) and parts[0] in ("unstructured", "channels"):
        try:
            amount = float(parts[1])
        except ValueError:
            raise ValueError(f"prune {text!r}: amount {parts[1]!r} is not a number; use "
                             f"{PRUNE_FORMS}") from None
        spec: dict[str, Any] = {"method": parts[0], "amount": amount}
        if len(parts) == 3:
            if parts[0] != "unstructured" or parts[2] not in ("global", "layer"):
                raise ValueError(f"prune {text!r}: use {PRUNE_FORMS}")
            spec["scope"] = parts[2]
        return spec
    raise ValueError(f"prune {text!r} is not understood: use {PRUNE_FORMS}")


class RecoveryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=120, ge=0)
    """Optimizer steps of the fine-tune after pruning (0 = no fine-tune)."""
    lr: float | None = Field(default=None, gt=0.0)
    """Peak AdamW learning rate, cosine decay after a short warm-up (null = the checkpoint's
    own optimizer.lr: channel pruning has to re-learn features, and a tenth of the training
    LR recovers markedly less in the same steps)."""
    batch_size: int = Field(default=64, ge=1)
    """Samples per optimizer step."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay; 0 leaves the surviving weights' scale alone."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    samples: int = Field(default=512, ge=1, json_schema_extra=flag("calib"))
    """Training samples drawn (without replacement) to set the activation ranges."""
    method: CalibMethod = Field(default="minmax", json_schema_extra=flag("calib-method"))
    """minmax: observed range; percentile: clip at `percentile` of |x| (robust to outliers);
    entropy: KL-divergence-optimal threshold (TensorRT's classic calibrator)."""
    percentile: float = Field(default=99.999, gt=90.0, le=100.0)
    """percentile method only."""
    batch_size: int = Field(default=64, ge=1)
    """Samples per calibration batch fed to the calibrator."""
    seed: int = 0
    """Seed of the sample draw: the same job calibrates on the same samples."""


class OnnxExportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    opset: int = Field(default=18, ge=17, json_schema_extra=flag("opset"))
    """ONNX opset; >= 13 is needed for per-channel Q/DQ, 17 is the floor here."""
    exporter: Literal["dynamo", "torchscript"] = Field(
        default="dynamo", json_schema_extra=flag("exporter")
    )
    """dynamo: torch.export-based (PyTorch's default since 2.9, needs onnxscript, opset >= 18);
    torchscript: the legacy tracer, for opset 17 or models torch.export cannot capture."""
    dynamic_batch: bool = True
    """Leave the batch dimension symbolic so one file serves batch 1 and the job's batch."""
    simplify: Literal["auto", "onnxslim", "onnxsim", "off"] = "auto"
    """Graph simplification: auto uses onnxslim or onnxsim when installed, else skips."""

    @model_validator(mode="after")
    def _check(self) -> OnnxExportConfig:
        if self.exporter == "dynamo" and self.opset < 18:
            raise ValueError(
                f"onnx.opset={self.opset}: the dynamo exporter emits opset 18 or newer; set "
                "onnx.exporter=torchscript for opset 17"
            )
        return self


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_top1_drop_pts: float | None = Field(
        default=1.0, ge=0.0, json_schema_extra=flag("max-top1-drop")
    )
    """Largest allowed drop of the task's gate metric vs the FP32 reference, in percentage
    points: top-1 accuracy for a classifier, mAP@0.5:0.95 for a detector."""
    max_map50_drop_pts: float | None = Field(
        default=1.0, ge=0.0, json_schema_extra=flag("max-map50-drop")
    )
    """Detectors: largest allowed mAP@0.5 drop vs the FP32 reference, in percentage points
    (not applied to classifiers)."""
    max_abs_logit_delta: float | None = Field(
        default=None, ge=0.0, json_schema_extra=flag("max-logit-delta")
    )
    """Largest allowed |logit - reference logit| over the held-out split."""
    max_p50_ms_b1: float | None = Field(
        default=None, gt=0.0, json_schema_extra=flag("max-p50-ms-b1")
    )
    """Median latency at batch 1, milliseconds."""
    max_p99_ms_b1: float | None = Field(
        default=None, gt=0.0, json_schema_extra=flag("max-p99-ms-b1")
    )
    """99th-percentile latency at batch 1, milliseconds."""
    max_p50_ms_batch: float | None = Field(
        default=None, gt=0.0, json_schema_extra=flag("max-p50-ms")
    )
    """Median latency at `batch_size`, milliseconds."""
    max_p99_ms_batch: float | None = Field(
        default=None, gt=0.0, json_schema_extra=flag("max-p99-ms")
    )
    """99th-percentile latency at `batch_size`, milliseconds."""
    max_size_mb: float | None = Field(
        default=None, gt=0.0, json_schema_extra=flag("max-size-mb")
    )
    """Largest artefact file, megabytes (1e6 bytes)."""
    batch_size: int = Field(default=32, ge=1, json_schema_extra=flag("batch"))
    """The job's serving batch, timed besides batch 1."""
    latency_warmup: int = Field(default=5, ge=0)
    """Untimed runs before timing (allocations, kernel selection)."""
    latency_iters: int = Field(default=50, ge=2, json_schema_extra=flag("latency-iters"))
    """Timed runs per batch size; p99 is only meaningful from ~100."""
    threads: int = Field(default=1, ge=0, json_schema_extra=flag("threads"))
    """ONNX Runtime intra-op threads while gating (0 = all cores). One thread keeps the
    figures stable on a machine that is also fine-tuning."""
    eval_samples: int | None = Field(default=None, ge=1, json_schema_extra=flag("eval-samples"))
    """Held-out samples scored (null = the whole validation split)."""


class TensorRTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workspace_mb: int = Field(default=1024, ge=16, json_schema_extra=flag("trt-workspace-mb"))
    """Builder scratch memory limit; take it from the device profile (Orin Nano: a few
    hundred MB, as the GPU shares RAM with everything else)."""
    timing_cache: Path | None = Field(default=None, json_schema_extra=flag("trt-timing-cache"))
    """Kernel timing cache file, read if present and written back after the build
    (null = <out>/tensorrt.timing_cache)."""
    fp16: bool = True
    """Allow FP16 for layers that stay in float next to the INT8 ones."""
    max_batch: int = Field(default=32, ge=1)
    """Largest batch of the optimization profile (the profile runs from 1 to this)."""
    opt_batch: int | None = Field(default=None, ge=1)
    """Batch the kernels are tuned for (null = max_batch)."""


class FallbackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, json_schema_extra=flag("fallback"))
    """On a failed gate, retry at the next step instead of failing the job."""
    max_excluded_layers: int = Field(default=3, ge=0, json_schema_extra=flag("max-excluded-layers"))
    """INT8 retries leave the 1, 2, ... up to this many most sensitive layers in float."""
    fp16: bool = True
    """Try FP16 after the INT8 steps."""
    fp32: bool = True
    """Try FP32 last."""
    sensitivity_samples: int = Field(default=256, ge=1)
    """Calibration samples used to rank the layers' sensitivity."""
    qat: bool = Field(default=False, json_schema_extra=flag("qat"))
    """After the INT8 steps, before fp16: quantization-aware training (the int8-qat step: a
    short fake-quant fine-tune, then INT8 again). Off by default: it trains for minutes."""


class QatConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=300, ge=1, json_schema_extra=flag("qat-steps"))
    """Optimizer steps of the fake-quant fine-tune."""
    lr: float = Field(default=2e-4, gt=0.0)
    """Constant AdamW learning rate: low, the weights only adapt to the INT8 grid."""
    batch_size: int = Field(default=8, ge=1)
    """Samples per optimizer step."""
    seed: int = 0
    """Seed of the sample order."""


class ExportJob(BaseModel):
    """Everything one export needs; ``agentctl export`` and ``python -m exporters`` build it
    from their flags (or a YAML file), the agent from a job message."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path
    """A checkpoint directory (with COMPLETE) or a run directory (its final/ or latest)."""
    out_dir: Path = Field(json_schema_extra=flag("out"))
    """Where model.onnx / model.engine, model.fp32.onnx and report.json are written."""
    data: DataConfig | None = None
    """Calibration, recovery and held-out data (null = the checkpoint's own data config).
    Images are resized to the model's input size."""
    prune: PruneSpec | None = Field(default=None, json_schema_extra=flag(text=True))
    """2:4, unstructured:AMOUNT[:global] or channels:AMOUNT (null = no pruning)."""
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    """Fine-tune after pruning (masks kept); not run without pruning."""
    precision: Precision = Field(default="fp32", json_schema_extra=flag(each_choice=True))
    """First step of the fallback chain: int8 -> fp16 -> fp32."""
    target: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    """onnxruntime: the ONNX file is the artefact; tensorrt: an engine built from it."""
    int8_recipe: Literal["auto", "s8s8-symmetric", "u8s8-reduce-range"] = "auto"
    """auto: s8s8-symmetric for TensorRT, for x86 with VNNI and for ARM; u8s8-reduce-range
    (uint8 activations, weights in [-64, 64]) for ONNX Runtime on x86 without VNNI, where it
    is the fast exact form. Set it to build for another host than this one."""
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    onnx: OnnxExportConfig = Field(default_factory=OnnxExportConfig)
    gates: GateConfig = Field(default_factory=GateConfig)
    fallback: FallbackConfig = Field(default_factory=FallbackConfig)
    qat: QatConfig = Field(default_factory=QatConfig)
    """The fine-tune of the int8-qat step (`fallback.qat`)."""
    tensorrt: TensorRTConfig = Field(default_factory=TensorRTConfig)
    keep_intermediates: bool = False
    """Keep <out>/work (every attempt's artefact, the calibration cache)."""

    @model_validator(mode="after")
    def _check(self) -> ExportJob:
        if self.target == "tensorrt" and self.int8_recipe == "u8s8-reduce-range":
            raise ValueError(
                "int8_recipe=u8s8-reduce-range cannot build a TensorRT engine: TensorRT takes "
                "symmetric int8 only; use int8_recipe=auto or s8s8-symmetric"
            )
        if self.target == "tensorrt" and self.gates.batch_size > self.tensorrt.max_batch:
            raise ValueError(
                f"gates.batch_size={self.gates.batch_size} exceeds tensorrt.max_batch="
                f"{self.tensorrt.max_batch}: the engine could not run the gated batch; raise "
                "tensorrt.max_batch or lower gates.batch_size"
            )
        return self
