"""YOLO folders: normalized centre boxes become the same xyxy pixels as COCO's; bad lines are
refused with their file and line number."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpc_core.tasks.detection.boxes import DetectionDataError
from hpc_core.tasks.detection.coco import load_coco
from hpc_core.tasks.detection.yolo import load_yolo, write_yolo

from .conftest import write_png

# On the 100x80 image: centre (25, 40), size 30 x 40 -> xyxy [10, 20, 40, 60], the box COCO's
# [10, 20, 30, 40] is in the COCO tests.
GOOD_A = "0 0.25 0.5 0.3 0.5\n\n1 0.5 0.5 1.0 1.0\n"


def test_a_good_folder_loads_with_the_same_boxes_as_coco(yolo_folder, coco_folder) -> None:
    d = load_yolo(yolo_folder({"a": GOOD_A}))
    assert d.class_names == ["square", "circle"]
    a, b = d.records
    assert (a.image_id, a.file_name, a.width, a.height) == (1, "a.png", 100, 80)
    np.testing.assert_allclose(a.boxes, [[10, 20, 40, 60], [0, 0, 100, 80]], atol=1e-4)
    assert a.labels.tolist() == [0, 1]
    coco = load_coco(coco_folder())
    np.testing.assert_allclose(a.boxes[0], coco.records[0].boxes[0], atol=1e-4)
    assert coco.class_names[coco.records[0].labels[0]] == d.class_names[a.labels[0]]
    # b.png has no label file: a background image, no objects
    assert b.boxes.shape == (0, 4) and b.labels.shape == (0,)


def test_names_from_a_map_or_classes_txt(yolo_folder, tmp_path: Path) -> None:
    d = load_yolo(yolo_folder({}, ("data.yaml", "nc: 2\nnames: {0: square, 1: circle}\n")))
    assert d.class_names == ["square", "circle"]
    (tmp_path / "yolo" / "data.yaml").unlink()
    (tmp_path / "yolo" / "classes.txt").write_text("square\ncircle\n")
    assert load_yolo(tmp_path / "yolo").class_names == ["square", "circle"]


def test_a_split_sub_folder(tmp_path: Path) -> None:
    write_png(tmp_path / "images" / "train" / "x.png", 40, 40)
    (tmp_path / "labels" / "train").mkdir(parents=True)
    (tmp_path / "labels" / "train" / "x.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    (tmp_path / "classes.txt").write_text("thing\n")
    d = load_yolo(tmp_path, split="train")
    np.testing.assert_allclose(d.records[0].boxes, [[10, 10, 30, 30]], atol=1e-4)


def _refusal(folder: Path) -> str:
    with pytest.raises(DetectionDataError) as e:
        load_yolo(folder)
    return str(e.value)


def test_bad_lines_are_refused_with_their_line_number(yolo_folder) -> None:
    folder = yolo_folder({"a": "0 0.25 0.5 0.3 0.5\n0 0.5 0.5 0.3\n0 a b c d\n",
                          "b": "5 0.5 0.5 0.1 0.1\n0 0.5 0.5 0.1 0.1 0.2 0.2\n"})
    msg = _refusal(folder)
    assert "4 problem(s)" in msg
    assert "a.txt:2: expected 5 fields 'class cx cy w h', got 4" in msg
    assert "a.txt:3: '0 a b c d' is not 'class cx cy w h'" in msg
    assert "b.txt:1: class 5 is not in 0 .. 1" in msg
    assert "b.txt:2: expected 5 fields" in msg and "segment polygon" in msg


def test_a_box_outside_the_image_is_refused_or_clipped_on_request(yolo_folder) -> None:
    folder = yolo_folder({"a": "0 0.9 0.5 0.4 0.5\n"})  # x from 70 to 110 on 100 px
    msg = _refusal(folder)
    assert "a.txt:1" in msg and "10 px outside the 100x80 image" in msg
    d = load_yolo(folder, on_outside="clip")
    np.testing.assert_allclose(d.records[0].boxes, [[70, 20, 100, 60]], atol=1e-4)


def test_a_box_without_area_is_refused(yolo_folder) -> None:
    assert "non-positive width" in _refusal(yolo_folder({"a": "0 0.5 0.5 0 0.2\n"}))


def test_names_problems_are_refused(yolo_folder, tmp_path: Path) -> None:
    assert "the file is empty" in _refusal(yolo_folder({}, ("data.yaml", "\n")))
    (tmp_path / "yolo" / "data.yaml").write_text("nc: 3\nnames: [a, b]\n")
    assert "nc: 3 but names has 2" in _refusal(tmp_path / "yolo")
    (tmp_path / "yolo" / "data.yaml").write_text("names: {0: a, 2: b}\n")
    assert "number the classes from 0 without gaps" in _refusal(tmp_path / "yolo")
    (tmp_path / "yolo" / "data.yaml").unlink()
    assert "no data.yaml and no classes.txt" in _refusal(tmp_path / "yolo")


def test_an_unreadable_image_and_an_orphan_label_are_refused(yolo_folder, tmp_path) -> None:
    folder = yolo_folder({"a": GOOD_A, "c": "0 0.5 0.5 0.1 0.1\n"})
    (folder / "images" / "b.png").write_bytes(b"")
    msg = _refusal(folder)
    assert "b.png: not a readable image" in msg
    assert "c.txt: no image c.*" in msg


def test_written_back_it_loads_equal(yolo_folder, tmp_path: Path) -> None:
    d = load_yolo(yolo_folder({"a": GOOD_A}))
    out = tmp_path / "again"
    (out / "images").mkdir(parents=True)
    for name in ("a.png", "b.png"):
        (out / "images" / name).write_bytes((d.images_dir / name).read_bytes())
    write_yolo(out, d)
    again = load_yolo(out)
    assert again.class_names == d.class_names
    for r, s in zip(d.records, again.records, strict=True):
        np.testing.assert_allclose(r.boxes, s.boxes, atol=1e-3)
        assert r.labels.tolist() == s.labels.tolist()
