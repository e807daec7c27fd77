"""The torch side of a registry version: rebuild its module, check it, read a checkpoint.

``registry`` is torch-free (devices read manifests before they need torch); what needs
torch - building the module a model spec names, comparing its state dict with a manifest's
tensors, reading a checkpoint's publishable content - lives here.

A registered model's tensors are known without torch (``hpc_core.model_layout``); a device
pull of a custom factory runs this check in a short-lived child process, so the long-lived
daemon and job worker never hold torch's ~200 MB (``agent.storage.spec_check``)::

    python -m hpc_core.model_spec check --manifest FILE [--allow-custom-model]

exits 0 when the tensors match, 3 with the refusal on the last line of stderr when they do
not, 2 when FILE cannot be read; stdout carries one JSON line with the child's peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from hpc_core.model_layout import (
    compare_tensors,
    compare_tensors_to_layout,
    custom_refused,
    is_custom,
    is_ecosystem,
)
from registry.errors import PublishError, RegistryError, SpecMismatchError
from registry.lifetime import skip_startup_and_exit_collections
from registry.manifest import LayoutRecord, Manifest, PretrainedWeights, TrainingInfo
from registry.model_config import ModelConfig
from registry.publish import VersionContent
from registry.safetensors_io import read_safetensors_index


def torch_dtype_name(dtype: Any) -> str:
    import torch

    names = {
        torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
        torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32",
        torch.int64: "I64", torch.float64: "F64",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    }
    if dtype not in names:
        raise SpecMismatchError(f"dtype {dtype} has no safetensors name")
    return names[dtype]


def build_module(spec: ModelConfig, *, meta: bool = False, allow_custom: bool = True) -> Any:
    """Rebuild the module a spec describes; ``meta`` builds shapes only (no memory, no init)."""
    import torch

    from hpc_core.models import build_model

    if is_custom(spec.name) and not allow_custom:
        raise custom_refused(spec.name)
    # Meta tensors carry shape and dtype only: checking a 10 GB spec costs no memory.
    where = torch.device("meta") if meta else contextlib.nullcontext()
    try:
        with where:
            return build_model(
                spec.name, num_classes=spec.num_classes, in_channels=spec.in_channels,
                image_size=spec.image_size, **spec.kwargs,
            )
    except ValueError as e:
        raise SpecMismatchError(f"model spec {spec.name!r} does not build: {e}") from None


def check_against_spec(manifest: Manifest, *, allow_custom: bool = False) -> None:
    """Tensor names, dtypes and shapes must be exactly those of the module the spec builds."""
    module = build_module(manifest.model, meta=True, allow_custom=allow_custom)
    want = {k: (torch_dtype_name(v.dtype), tuple(v.shape)) for k, v in module.state_dict().items()}
    compare_tensors(manifest, want)


def read_checkpoint(source: Path, *, layout: LayoutRecord | None = None) -> VersionContent:
    """Resolve a run or checkpoint dir and read its weights' layout, spec and metrics.

    ``layout``: one already recorded for this checkpoint's spec (a version staged from it):
    an ecosystem model's layout is then taken from it instead of building the module, which
    imports torch and its model library (~300 MB in a process that had neither). The tensors
    are checked against it either way; a layout of another spec is not used."""
    from hpc_core.checkpoint_layout import CheckpointError, read_trainer_state, resolve_checkpoint
    from hpc_core.config import ConfigError, config_from_dict

    try:
        ckpt = resolve_checkpoint(Path(source))
        state = read_trainer_state(ckpt)
    except (CheckpointError, OSError, ValueError) as e:
        raise PublishError(f"cannot read checkpoint {source}: {e}") from None
    try:
        cfg = config_from_dict(state["config"], source=f"{ckpt}/trainer_state.json")
    except (KeyError, ConfigError) as e:
        raise PublishError(f"{ckpt}/trainer_state.json has no valid config: {e}") from None
    m = cfg.model
    if None in (m.num_classes, m.in_channels, m.image_size):
        raise PublishError(
            f"{ckpt}: config.model is not resolved (num_classes, in_channels, image_size are "
            "needed to rebuild the module on a device)"
        )
    metrics = {
        k: float(v) for k, v in (state.get("metrics") or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    pretrained = None
    if m.weights is not None:  # the manifest records which file, never where it was
        pretrained = PretrainedWeights(sha256=m.weights.sha256, file=Path(m.weights.path).name)
    training = TrainingInfo(config_sha256=cfg.digest(), step=state.get("step"),
                            epoch=state.get("epoch"), metrics=metrics, pretrained=pretrained)
    tensors = read_safetensors_index(ckpt / "model.safetensors")
    spec = m.model_copy(update={"weights": None})
    if not is_ecosystem(spec.name):
        layout = None
    elif layout is None or layout.built_from != spec:
        layout = record_layout(spec)
    if layout is not None:
        compare_tensors_to_layout(layout, {t.name: (t.dtype, tuple(t.shape)) for t in tensors},
                                  source=str(ckpt / "model.safetensors"))
    return VersionContent(ckpt, spec, training, tensors, layout)


def record_layout(spec: ModelConfig) -> LayoutRecord:
    """Build the module (meta tensors) and record its state dict's layout, with the
    libraries that built it: what a device checks a torchvision/timm version against."""
    module = build_module(spec, meta=True)
    tensors = {k: (torch_dtype_name(v.dtype), tuple(v.shape))
               for k, v in module.state_dict().items()}
    return LayoutRecord(built_from=spec, built_with=_libraries(spec.name), tensors=tensors)


def _libraries(name: str) -> str:
    import importlib.metadata

    libs = ["torch", name.partition("/")[0]]
    if name.startswith("timm/"):
        libs.append("torchvision")
    return ", ".join(f"{lib} {importlib.metadata.version(lib)}" for lib in dict.fromkeys(libs))


def _peak_rss_mb() -> float:
    from hpc_core.metrics import peak_rss_mb  # torch: only the check child gets here

    return peak_rss_mb()


def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    ap = argparse.ArgumentParser(
        prog="python -m hpc_core.model_spec",
        description="Check a verified manifest's tensors against the module its spec builds.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="exit 0: match, 3: mismatch (reason on stderr)")
    check.add_argument("--manifest", required=True, type=Path, help="manifest.json to check")
    check.add_argument("--allow-custom-model", action="store_true",
                       help="build a spec that names a Python factory (module:function)")
    args = ap.parse_args(argv)
    code = 0
    try:
        manifest = Manifest.from_bytes(args.manifest.read_bytes(), source=str(args.manifest))
        check_against_spec(manifest, allow_custom=args.allow_custom_model)
    except SpecMismatchError as e:
        print(e, file=sys.stderr)
        code = 3
    except (OSError, RegistryError) as e:
        print(f"cannot check {args.manifest}: {e}", file=sys.stderr)
        code = 2
    print(json.dumps({"peak_rss_bytes": int(_peak_rss_mb() * 2**20)}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
