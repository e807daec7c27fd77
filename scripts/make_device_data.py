"""Write a "device" data set: sklearn's digits as a particular device's camera sees them.

The distortions (hpc_core.cameras) model real sensor differences between the upstream data
and one device:
  invert   an IR / backlit camera: dark strokes on a bright field (x -> 1 - x)
  noise    sensor read noise: additive Gaussian, sigma 0.15, clipped to [0, 1]
  blur     a soft lens: 3x3 box blur
  rotate   a camera mounted 90 degrees off

    python scripts/make_device_data.py --distortion invert,noise --out device.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from hpc_core.cameras import KINDS, distort
from hpc_core.data import load_digits_tensors
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections


def make_device_data(out: Path, kinds: list[str], image_size: int = 16, seed: int = 0) -> Path:
    x, y = load_digits_tensors(image_size)
    x = distort(x, kinds, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, x=(x.numpy() * 255).round().astype(np.uint8), y=y.numpy())
    return out


@private_umask()
def main() -> None:
    skip_startup_and_exit_collections()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--distortion", default="invert,noise", help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    print(make_device_data(a.out, a.distortion.split(","), a.image_size, a.seed))


if __name__ == "__main__":
    main()
