"""``hpc-train convert-weights``: its parser, which imports no torch (``hpc-train`` builds every
command's parser at start), and its run, which does (``hpc_core.vision.weights``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register_cli(sub: Any) -> None:
    """``hpc-train convert-weights IN.pth OUT.safetensors``."""
    c = sub.add_parser(
        "convert-weights",
        help="turn a .pth state dict (torchvision/timm checkpoint) into safetensors, once",
        description="Read IN (a .pth, with torch.load(weights_only=True): a pickle holding "
        "anything but tensors and plain containers is refused) and write its tensors to OUT "
        "as safetensors; print the sha256 to pin in the config's model.weights. "
        "Checkpoints that wrap the state dict ({'state_dict': ...}, {'model': ...}) are "
        "unwrapped.",
        epilog="example:\n  hpc-train convert-weights resnet18-f37072fd.pth resnet18.safetensors"
        "\n  # then in the config:\n  model: {name: torchvision/resnet18, weights: {path: "
        "resnet18.safetensors, sha256: <printed>}}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("src", type=Path, metavar="IN", help="the .pth file")
    c.add_argument("dst", type=Path, metavar="OUT", help="the .safetensors file to write")
    c.set_defaults(func=run_convert_weights)


def run_convert_weights(args: argparse.Namespace) -> int:
    from hpc_core.vision.weights import WeightsError, convert_to_safetensors

    if args.dst.exists():
        print(f"convert-weights: {args.dst} exists: give a new path", file=sys.stderr)
        return 2
    try:
        n, digest = convert_to_safetensors(args.src, args.dst)
    except (OSError, WeightsError) as e:
        print(f"convert-weights: {e}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {n} tensors, sha256 {digest}")
    return 0
