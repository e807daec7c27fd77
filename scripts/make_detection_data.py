"""Write a synthetic object-detection set: no download, deterministic for a seed.

Each image (default 320x320) holds 1 to 6 objects on a textured background (noise, a
gradient or stripes). Thirteen classes: digit_0 .. digit_9 (sklearn's bundled 8x8 digits,
upscaled) and square, circle, triangle. Objects overlap a little (at most 30 % of the smaller
one covered) and a quarter of them touch an image edge. Every class appears in any 13
consecutive images.

--classes, --objects and --object-size make the set easier or harder: a subset of the classes
(labelled in the order given), fewer or more objects per image, larger or smaller objects.

--camera applies a device's camera to the whole image, as scripts/make_device_data.py does to
digits, so a device's set is camera-shifted against the upstream one:
  invert   an IR / backlit camera (x -> 1 - x)
  noise    sensor read noise, sigma 0.15
  blur     a soft lens, 3x3 box blur
  rotate   a camera mounted 90 degrees off (boxes are rotated with the pixels)

The folder it writes (whole or not at all; folders 0700, files 0600):
  OUT/images/000000.png ...
  OUT/annotations.json          --format coco (COCO detection JSON, xywh pixels)
  OUT/labels/000000.txt ...     --format yolo (class cx cy w h, normalized)
  OUT/data.yaml                 --format yolo (the class names)

    python scripts/make_detection_data.py --out det-upstream --images 200
    python scripts/make_detection_data.py --out det-cam0 --images 50 --seed 1 \\
        --camera invert,noise --format coco,yolo
    python scripts/make_detection_data.py --out det-shapes --images 200 \\
        --classes square,circle,triangle --objects 1,3 --object-size 0.15,0.4

Load it with hpc_core.tasks.detection.coco.load_coco or .yolo.load_yolo
(docs/how-to/detection-data.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_core.tasks.detection.synthetic import (
    CAMERAS,
    CLASS_NAMES,
    DEFAULT_SCENES,
    FORMATS,
    Scenes,
    write_synthetic,
)
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections


def _list(text: str) -> list[str]:
    return [t for t in text.split(",") if t and t != "none"]


def _pair(text: str) -> tuple[str, str]:
    low, sep, high = text.partition(",")
    if not sep or "," in high:
        raise ValueError(f"{text!r}: give MIN,MAX")
    return low, high


@private_umask()
def main() -> None:
    skip_startup_and_exit_collections()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True,
                   help="folder to create (must not exist, or be empty)")
    p.add_argument("--images", type=int, default=100, help="number of images (default 100)")
    p.add_argument("--size", type=int, default=320,
                   help="image side in pixels (default 320, an SSD-lite input)")
    p.add_argument("--seed", type=int, default=0,
                   help="the set's seed: the same seed writes the same set (default 0)")
    p.add_argument("--camera", default="none",
                   help=f"comma list of {', '.join(CAMERAS)}, applied in order (default none)")
    p.add_argument("--format", default="coco",
                   help=f"comma list of {', '.join(FORMATS)} (default coco)")
    p.add_argument("--classes", default="all",
                   help=f"comma list out of {', '.join(CLASS_NAMES)}, labelled in this order "
                   "(default all)")
    lo, hi = DEFAULT_SCENES.objects
    p.add_argument("--objects", default=f"{lo},{hi}",
                   help=f"objects per image, MIN,MAX (default {lo},{hi})")
    small, large = DEFAULT_SCENES.object_size
    p.add_argument("--object-size", default=f"{small:g},{large:g}",
                   help="object side as a share of the image side, MIN,MAX "
                   f"(default {small:g},{large:g})")
    a = p.parse_args()
    if a.images < 1 or a.size < 32:
        p.error("--images must be at least 1 and --size at least 32")
    try:
        classes = CLASS_NAMES if a.classes == "all" else _list(a.classes)
        fewest, most = _pair(a.objects)
        smallest, largest = _pair(a.object_size)
        scenes = Scenes(tuple(classes), (int(fewest), int(most)),
                        (float(smallest), float(largest)))
    except ValueError as e:
        p.error(f"--classes, --objects or --object-size: {e}")
    try:
        out = write_synthetic(a.out, a.images, a.size, a.seed, _list(a.camera),
                              _list(a.format), scenes)
    except (ValueError, FileExistsError) as e:
        p.error(str(e))
    print(out)


if __name__ == "__main__":
    main()
