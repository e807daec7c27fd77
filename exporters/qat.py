"""Quantization-aware training: the ``int8-qat`` step of the fallback chain.

When post-training INT8 misses its gates (and leaving the most sensitive layers in float did
not help), the model is fine-tuned for a few hundred steps with INT8 simulated in its forward
pass, so that its weights settle where the INT8 grid costs least, then quantized again:

1. BatchNorm is folded into the convolution before it (eval statistics), as ONNX Runtime's
   pre-processing folds it before quantizing: the weights trained are the weights quantized;
2. every ``Conv2d`` is wrapped in :class:`FakeQuantConv`, which mirrors the Q/DQ recipe the
   fallback steps use (``s8s8-symmetric``): weights per output channel, symmetric, scale
   ``max|w| / 127`` (what ONNX Runtime computes for them); the input activation per tensor,
   symmetric, its range followed by a moving average of the batch maxima (what minmax
   calibration measures); rounding passes gradients straight through;
3. the project's one training loop (``hpc_core.trainer.Trainer``) runs the task's own loss
   on the job's training split (a detector's: torchvision's SSD losses), at a low learning
   rate;
4. the wrappers are removed and the network exported to FP32 ONNX (a detector: its core,
   ``exporters.detection.core``), which ``exporters.pipeline`` quantizes with the recipe
   mirrored here: the weight scales are those the fine-tune trained against, by
   construction, and the convolutions' input scales are the fine-tune's own (below).

Only Conv2d is simulated (ONNX Runtime also quantizes the activations around Add, Concat and
the like: their rounding is not trained against). A pruned model is not fine-tuned here: the
fine-tune would fill its zeros again.

The activation ranges the fine-tune ended with go with it (:func:`activation_ranges`, keyed
by each convolution's weights): the pipeline sets them as the Q/DQ ranges of those
convolutions' inputs (ONNX Runtime's ``TensorQuantOverrides``), so the file carries the
scales the fine-tune trained against, weights and activations.

Torch: the quantizing half of an export (``exporters.pipeline``) never imports torch, so it
runs this module as a child process, ``python -m exporters.qat JOB OUT``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from registry.atomic import write_json_atomic
from registry.lifetime import die_with_parent, skip_startup_and_exit_collections

QMAX = 127
"""Symmetric int8 as ONNX Runtime quantizes it: [-127, 127], zero-point 0."""


class FakeQuantConv(nn.Module):
    """A Conv2d whose input and weights are rounded to symmetric int8 in the forward pass."""

    def __init__(self, conv: nn.Conv2d, momentum: float = 0.01) -> None:
        super().__init__()
        self.conv = conv
        self.momentum = momentum
        self.register_buffer("act_absmax", torch.zeros(()))
        self.register_buffer("seen", torch.zeros((), dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                batch_max = x.detach().abs().amax()
                if not bool(self.seen):
                    self.act_absmax.copy_(batch_max)
                    self.seen.fill_(True)
                else:
                    self.act_absmax.lerp_(batch_max, self.momentum)
        scale = (self.act_absmax / QMAX).clamp(min=1e-8).reshape(1).float()
        zero = torch.zeros(1, dtype=torch.int32, device=x.device)
        xq = torch.fake_quantize_per_tensor_affine(x, scale, zero, -QMAX, QMAX)
        w = self.conv.weight
        w_scale = (w.detach().abs().amax(dim=(1, 2, 3)) / QMAX).clamp(min=1e-8).float()
        w_zero = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
        wq = torch.fake_quantize_per_channel_affine(w, w_scale, w_zero, 0, -QMAX, QMAX)
        c = self.conv
        return F.conv2d(xq, wq, c.bias, c.stride, c.padding, c.dilation, c.groups)


def fold_batchnorm(model: nn.Module) -> int:
    """Fold each BatchNorm2d that follows a Conv2d in an ``nn.Sequential`` into that conv
    (eval statistics), leaving an Identity in its place; the number folded."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    model.eval()
    folded = 0
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(seq._modules)
        for a, b in itertools.pairwise(names):
            conv, bn = seq._modules[a], seq._modules[b]
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                seq._modules[a] = fuse_conv_bn_eval(conv, bn)
                seq._modules[b] = nn.Identity()
                folded += 1
    return folded


def _swap(model: nn.Module, match: type, make: type | None) -> int:
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, match) and not isinstance(parent, FakeQuantConv):
                setattr(parent, name, make(child) if make else child.conv)
                swapped += 1
    return swapped


def insert_fake_quant(model: nn.Module) -> int:
    """Wrap every Conv2d of ``model`` in :class:`FakeQuantConv`; the number wrapped."""
    return _swap(model, nn.Conv2d, FakeQuantConv)


def remove_fake_quant(model: nn.Module) -> int:
    """Put the trained convolutions back in place of their wrappers."""
    return _swap(model, FakeQuantConv, None)


def weight_key(weight: object) -> str:
    """A convolution's identity across the export: the SHA-1 of its float32 weights (the
    ONNX graph renames tensors, the weights it keeps bit for bit)."""
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(weight, dtype=np.float32))
    return hashlib.sha1(arr.tobytes()).hexdigest()


def activation_ranges(model: nn.Module) -> dict[str, float]:
    """Each fake-quantized convolution's input range (max |x|), by :func:`weight_key`."""
    return {weight_key(m.conv.weight.detach().cpu().numpy()): float(m.act_absmax)
            for m in model.modules() if isinstance(m, FakeQuantConv)}


def qat_finetune(job_path: Path, out: Path) -> dict[str, object]:
    """Fine-tune the job's model under fake quantization and export its quantizable FP32
    graph under ``out``; what the pipeline reads back (the graph's path, the fine-tune's
    final metrics)."""
    from exporters.job import ExportJob, RecoveryConfig
    from exporters.prepare import form_of, load_source
    from exporters.recovery import recovery_train_config
    from hpc_core.trainer import Trainer

    t0 = time.perf_counter()
    job = ExportJob.model_validate_json(job_path.read_text())
    src = load_source(job)
    model = src.model
    folded = fold_batchnorm(model)
    wrapped = insert_fake_quant(model)
    q = job.qat
    cfg = recovery_train_config(
        src.config, RecoveryConfig(steps=q.steps, lr=q.lr, batch_size=q.batch_size,
                                   weight_decay=0.0), out / "train", len(src.train))  # type: ignore[arg-type]
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": q.seed,
                                                                   "name": "export-qat"})})
    result = Trainer(cfg, model=model, datasets=(src.train, src.val)).train()
    model.cpu().eval()
    ranges = activation_ranges(model)
    remove_fake_quant(model)
    exported = form_of(src.config.task).export(model, out / "qat.fp32.onnx", src.input_shape,
                                               job.onnx, out)
    core = exported.core or exported.onnx.path
    return {"core": str(core), "steps": result.final_step, "metrics": result.metrics,
            "activation_ranges": ranges,
            "folded_batchnorms": folded, "fake_quant_convs": wrapped,
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m exporters.qat JOB_JSON OUT_DIR", file=sys.stderr)
        return 2
    # The export that started it may be killed at its job's deadline: never train on alone.
    die_with_parent()
    out = Path(args[1])
    result = qat_finetune(Path(args[0]), out)
    write_json_atomic(out / "qat.json", json.loads(json.dumps(result, default=float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
