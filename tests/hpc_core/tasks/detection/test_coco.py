"""COCO folders: a good one loads with its boxes in xyxy pixels; each kind of bad input is
refused with the file, the id and the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from hpc_core.tasks.detection.boxes import DetectionDataError
from hpc_core.tasks.detection.coco import coco_dict, load_coco, write_coco

from .conftest import coco_tree


def test_a_good_folder_loads_in_the_project_convention(coco_folder) -> None:
    d = load_coco(coco_folder())
    # classes in category-id order, whatever the file's order
    assert d.class_names == ["square", "circle"] and d.category_ids == [3, 7]
    a, b = d.records
    assert (a.image_id, a.file_name, a.width, a.height) == (1, "a.png", 100, 80)
    # COCO's [x, y, w, h] = [10, 20, 30, 40] is xyxy [10, 20, 40, 60]
    np.testing.assert_array_equal(a.boxes, [[10, 20, 40, 60], [0, 0, 100, 80]])
    assert a.boxes.dtype == np.float32 and a.labels.dtype == np.int64
    assert a.labels.tolist() == [0, 1]
    assert a.iscrowd.tolist() == [False, True]  # kept for the metric
    np.testing.assert_allclose(b.boxes, [[1.5, 2.5, 11.5, 22.5]])
    assert d.image_path(1) == coco_folder().parent / "coco" / "images" / "b.png"


def test_written_back_it_loads_equal(coco_folder, tmp_path: Path) -> None:
    d = load_coco(coco_folder())
    write_coco(tmp_path / "coco", d)
    again = load_coco(tmp_path / "coco")
    assert again.class_names == d.class_names and again.category_ids == d.category_ids
    for r, s in zip(d.records, again.records, strict=True):
        np.testing.assert_array_equal(r.boxes, s.boxes)
        assert r.labels.tolist() == s.labels.tolist()
        assert r.iscrowd.tolist() == s.iscrowd.tolist()
    ids = [a["id"] for a in coco_dict(d)["annotations"]]
    assert min(ids) == 1  # pycocotools reads an id of 0 as "unmatched"


def test_an_instances_file_under_annotations_is_found(coco_folder) -> None:
    folder = coco_folder()
    (folder / "annotations").mkdir()
    (folder / "annotations.json").rename(folder / "annotations" / "instances_val.json")
    assert len(load_coco(folder).records) == 2


def _refusal(coco_folder, tree: dict) -> str:
    with pytest.raises(DetectionDataError) as e:
        load_coco(coco_folder(tree))
    return str(e.value)


def test_a_box_outside_the_image_is_refused_or_clipped_on_request(coco_folder) -> None:
    tree = coco_tree()
    tree["annotations"][0]["bbox"] = [80, 20, 30, 40]  # reaches x = 110 on a 100-wide image
    msg = _refusal(coco_folder, tree)
    assert "annotations.json" in msg and "annotation id 5 (image id 1)" in msg
    assert "10 px outside the 100x80 image" in msg and "refused" in msg
    assert "on_outside='clip'" in msg
    d = load_coco(coco_folder(tree), on_outside="clip")
    np.testing.assert_array_equal(d.records[0].boxes[0], [80, 20, 100, 60])


def test_a_box_within_the_tolerance_is_clipped(coco_folder) -> None:
    tree = coco_tree()
    tree["annotations"][0]["bbox"] = [-0.5, 20, 101, 40]  # 0.5 px over on each side
    d = load_coco(coco_folder(tree))
    np.testing.assert_array_equal(d.records[0].boxes[0], [0, 20, 100, 60])


@pytest.mark.parametrize("bbox", [[10, 20, 0, 40], [10, 20, 30, -1]])
def test_a_box_without_area_is_refused(coco_folder, bbox: list[float]) -> None:
    tree = coco_tree()
    tree["annotations"][2]["bbox"] = bbox
    msg = _refusal(coco_folder, tree)
    assert "annotation id 9 (image id 2)" in msg and "non-positive width or height" in msg


def test_an_unknown_category_is_refused(coco_folder) -> None:
    tree = coco_tree()
    tree["annotations"][0]["category_id"] = 4
    msg = _refusal(coco_folder, tree)
    assert "annotation id 5" in msg and "category_id 4 is not in categories (known: 3, 7)" in msg


def test_a_missing_or_unreadable_image_is_refused(coco_folder) -> None:
    folder = coco_folder()
    (folder / "images" / "a.png").unlink()
    (folder / "images" / "b.png").write_bytes(b"not a png")
    with pytest.raises(DetectionDataError) as e:
        load_coco(folder)
    msg = str(e.value)
    assert "2 problem(s)" in msg
    assert "image id 1: file a.png is missing" in msg
    assert "image id 2: file b.png is not a readable image" in msg


def test_an_image_of_another_size_than_declared_is_refused(coco_folder) -> None:
    tree = coco_tree()
    folder = coco_folder(tree)
    tree["images"][1]["width"] = 64
    (folder / "annotations.json").write_text(json.dumps(tree))
    with pytest.raises(DetectionDataError, match=r"b\.png is 60x60, the JSON says 64x60"):
        load_coco(folder)


def test_an_empty_or_broken_file_is_refused(coco_folder) -> None:
    folder = coco_folder()
    (folder / "annotations.json").write_text("  \n")
    with pytest.raises(DetectionDataError, match="the file is empty"):
        load_coco(folder)
    (folder / "annotations.json").write_text("{\"images\": [")
    with pytest.raises(DetectionDataError, match="not JSON"):
        load_coco(folder)
    (folder / "annotations").mkdir()
    (folder / "annotations.json").unlink()
    with pytest.raises(DetectionDataError, match=r"no annotations\.json"):
        load_coco(folder)


def test_duplicate_ids_are_refused(coco_folder) -> None:
    tree = coco_tree()
    tree["annotations"][1]["id"] = 5
    tree["categories"].append({"id": 3, "name": "again"})
    msg = _refusal(coco_folder, tree)
    assert "annotation id 5 appears 2 times" in msg and "category id 3 appears 2 times" in msg


def test_an_annotation_of_an_unknown_image_is_refused(coco_folder) -> None:
    tree = coco_tree()
    tree["annotations"][0]["image_id"] = 42
    assert "image id 42 is not in images" in _refusal(coco_folder, tree)


def test_schema_errors_name_the_field(coco_folder) -> None:
    tree = copy.deepcopy(coco_tree())
    del tree["annotations"][1]["bbox"]
    tree["annotations"][2]["iscrowd"] = 2
    msg = _refusal(coco_folder, tree)
    assert "annotations.1.bbox: Field required (add this field)" in msg
    assert "annotations.2.iscrowd" in msg
