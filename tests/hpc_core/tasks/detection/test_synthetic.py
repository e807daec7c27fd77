"""The synthetic set: deterministic per seed, boxes inside the images and tight around what
was drawn, every class present, cameras applied with boxes kept right, and the COCO and YOLO
folders it writes loading back equal."""

from __future__ import annotations

import os
import runpy
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from hpc_core.tasks.detection import synthetic
from hpc_core.tasks.detection.coco import load_coco
from hpc_core.tasks.detection.synthetic import (
    CLASS_NAMES,
    DEFAULT_SCENES,
    Scenes,
    synthesize,
    write_synthetic,
)
from hpc_core.tasks.detection.yolo import load_yolo

ROOT = Path(__file__).resolve().parents[4]
SIZE = 96
SCRIPT = str(ROOT / "scripts" / "make_detection_data.py")


def test_the_same_seed_gives_the_same_set_and_another_seed_another() -> None:
    a_images, a = synthesize(4, SIZE, seed=3)
    b_images, b = synthesize(4, SIZE, seed=3)
    c_images, _ = synthesize(4, SIZE, seed=4)
    for x, y in zip(a_images, b_images, strict=True):
        assert np.array_equal(x, y)
    for r, s in zip(a.records, b.records, strict=True):
        assert np.array_equal(r.boxes, s.boxes) and np.array_equal(r.labels, s.labels)
    assert not np.array_equal(a_images[0], c_images[0])
    # a smaller set is the start of a larger one
    assert np.array_equal(synthesize(2, SIZE, seed=3)[0][1], a_images[1])


def test_boxes_lie_inside_the_images_and_every_class_appears() -> None:
    images, d = synthesize(len(CLASS_NAMES), SIZE, seed=0)
    assert d.class_names == CLASS_NAMES
    seen = set()
    for pixels, r in zip(images, d.records, strict=True):
        assert pixels.shape == (SIZE, SIZE, 3) and pixels.dtype == np.uint8
        assert len(r.boxes) >= 1 and r.boxes.dtype == np.float32
        assert (r.boxes[:, :2] >= 0).all() and (r.boxes[:, 2:] <= SIZE).all()
        assert (r.boxes[:, 2:] > r.boxes[:, :2]).all()
        seen |= set(r.labels.tolist())
    assert seen == set(range(len(CLASS_NAMES)))


def test_the_invert_camera_inverts_and_rotate_turns_boxes_with_pixels() -> None:
    plain_images, plain = synthesize(3, SIZE, seed=5)
    inv_images, _ = synthesize(3, SIZE, seed=5, cameras=["invert"])
    assert np.abs(inv_images[0].astype(int) - (255 - plain_images[0].astype(int))).max() <= 1
    rot_images, rot = synthesize(3, SIZE, seed=5, cameras=["rotate"])
    for p_img, r_img, p, r in zip(plain_images, rot_images, plain.records, rot.records,
                                  strict=True):
        assert np.array_equal(np.rot90(p_img, 1, axes=(0, 1)), r_img)
        # a box's lit pixels, found in the plain image, are under the rotated box in the
        # rotated one: the same pixel values, read in the rotated layout
        for pb, rb in zip(p.boxes.astype(int), r.boxes.astype(int), strict=True):
            x1, y1, x2, y2 = pb
            rx1, ry1, rx2, ry2 = rb
            assert np.array_equal(np.rot90(p_img[y1:y2, x1:x2], 1, axes=(0, 1)),
                                  r_img[ry1:ry2, rx1:rx2])
    with pytest.raises(ValueError, match="unknown camera 'sepia'"):
        synthesize(1, SIZE, cameras=["sepia"])


def test_written_coco_and_yolo_load_back_equal(tmp_path: Path) -> None:
    out = write_synthetic(tmp_path / "det", 6, SIZE, seed=2, cameras=["noise"],
                          formats=["coco", "yolo"])
    _, d = synthesize(6, SIZE, seed=2, cameras=["noise"])
    coco, yolo = load_coco(out), load_yolo(out)
    assert coco.class_names == yolo.class_names == CLASS_NAMES
    for r, c, y in zip(d.records, coco.records, yolo.records, strict=True):
        np.testing.assert_array_equal(c.boxes, r.boxes)
        np.testing.assert_allclose(y.boxes, r.boxes, atol=1e-3)
        assert r.labels.tolist() == c.labels.tolist() == y.labels.tolist()
        assert c.image_id == y.image_id == r.image_id
    # private: folders 0700, files 0600; nothing left behind beside it
    for p in [out, *out.rglob("*")]:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), p
    assert [p.name for p in tmp_path.iterdir()] == ["det"]
    with pytest.raises(FileExistsError, match="choose a new --out"):
        write_synthetic(out, 1, SIZE)


def _cli(*args: str) -> int:
    """scripts/make_detection_data.py run as ``python script args``, in this process."""
    argv = sys.argv
    sys.argv = [SCRIPT, *args]
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = argv
    return 0


def test_the_command_line_teaches_and_writes_a_set(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("--help") == 0
    help_text = capsys.readouterr().out
    assert "--camera" in help_text and "digit_0" in help_text
    assert "annotations.json" in help_text
    assert _cli("--out", str(tmp_path / "d"), "--images", "2", "--size", "64",
                "--camera", "blur,rotate", "--format", "yolo") == 0
    assert len(load_yolo(tmp_path / "d").records) == 2
    assert _cli("--out", str(tmp_path / "e"), "--format", "voc") == 2
    assert "use one or more of coco, yolo" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def _black(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthetic, "_background",
                        lambda size, rng: np.zeros((size, size, 3), dtype=np.float32))


def test_each_box_is_tight_around_its_drawn_object(monkeypatch: pytest.MonkeyPatch) -> None:
    # one object per image on a black background: every pixel the object changed is its own
    _black(monkeypatch)
    one = Scenes(objects=(1, 1))
    for i in range(len(CLASS_NAMES)):  # image i's object is of class i
        pixels, boxes, labels = synthetic.render(i, SIZE, seed=0, scenes=one)
        assert labels.tolist() == [i]
        ys, xs = np.nonzero(pixels.max(axis=2) > 0.35)  # over half covered (colour >= 0.7)
        lit = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        # the box is the extent of the pixels more than half covered; a bilinear edge may
        # light one more pixel a little
        np.testing.assert_allclose(boxes[0], lit, atol=1)


def test_scenes_draw_the_classes_counts_and_sizes_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _black(monkeypatch)
    shapes = Scenes(classes=("triangle", "square"), objects=(3, 3), object_size=(0.2, 0.3))
    _, d = synthesize(12, SIZE, seed=4, scenes=shapes)
    assert d.class_names == ["triangle", "square"]
    counts = []
    for i, r in enumerate(d.records):
        assert r.labels[0] == i % 2  # the first object cycles through the classes
        counts.append(len(r.labels))
        for x1, y1, x2, y2 in r.boxes.astype(int):
            assert round(0.2 * SIZE) <= max(x2 - x1, y2 - y1) <= round(0.3 * SIZE)
    # three each, unless no free place was found for one
    assert max(counts) == 3 and sum(c == 3 for c in counts) >= 9
    # alone on black, how much of its box an object fills tells the shape drawn: a square
    # all of it, a triangle (apex at the top, base along the bottom) half
    alone = Scenes(classes=("triangle", "square"), objects=(1, 1), object_size=(0.3, 0.4))
    images, d = synthesize(4, SIZE, seed=4, scenes=alone)
    for pixels, r in zip(images, d.records, strict=True):
        x1, y1, x2, y2 = r.boxes[0].astype(int)
        lit = pixels[y1:y2, x1:x2].max(axis=2) > 90  # drawn in colour >= 0.7
        assert lit.mean() == pytest.approx({0: 0.5, 1: 1.0}[int(r.labels[0])], abs=0.1)


def test_default_scenes_are_the_full_set_and_bad_scenes_are_refused() -> None:
    assert Scenes(tuple(CLASS_NAMES), (1, 6), (0.08, 0.35)) == DEFAULT_SCENES
    for bad, match in (({"classes": ("circle", "circle")}, "distinct names"),
                       ({"classes": ("hexagon",)}, "distinct names out of digit_0"),
                       ({"objects": (3, 2)}, "1 <= min <= max"),
                       ({"object_size": (0.0, 0.3)}, "0 < min <= max <= 1")):
        with pytest.raises(ValueError, match=match):
            Scenes(**bad)  # type: ignore[arg-type]
