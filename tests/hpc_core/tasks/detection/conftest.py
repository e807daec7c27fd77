from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image


def write_png(path: Path, width: int, height: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((height, width, 3), 128, dtype=np.uint8)).save(path)


def coco_tree(**changes: Any) -> dict[str, Any]:
    """A good COCO file: two images (100x80, 60x60), three annotations, two categories (ids
    3 and 7, as COCO's own ids have gaps); with the extra keys real files carry."""
    tree: dict[str, Any] = {
        "info": {"description": "test"}, "licenses": [],
        "images": [{"id": 1, "file_name": "a.png", "width": 100, "height": 80, "license": 0},
                   {"id": 2, "file_name": "b.png", "width": 60, "height": 60}],
        "annotations": [
            {"id": 5, "image_id": 1, "category_id": 3, "bbox": [10, 20, 30, 40], "area": 1200,
             "iscrowd": 0, "segmentation": [[10, 20, 40, 20, 40, 60]]},
            {"id": 6, "image_id": 1, "category_id": 7, "bbox": [0, 0, 100, 80], "iscrowd": 1,
             "attributes": {"occluded": False}},
            {"id": 9, "image_id": 2, "category_id": 7, "bbox": [1.5, 2.5, 10, 20]},
        ],
        "categories": [{"id": 7, "name": "circle", "supercategory": "shape"},
                       {"id": 3, "name": "square"}],
    }
    tree.update(changes)
    return tree


@pytest.fixture
def coco_folder(tmp_path: Path):
    """make(tree=None) -> a COCO folder with the images of ``tree`` written."""

    def make(tree: dict[str, Any] | None = None) -> Path:
        tree = coco_tree() if tree is None else tree
        folder = tmp_path / "coco"
        for image in tree["images"]:
            write_png(folder / "images" / image["file_name"], image["width"], image["height"])
        (folder / "annotations.json").write_text(json.dumps(tree))
        return folder

    return make


@pytest.fixture
def yolo_folder(tmp_path: Path):
    """make(labels, names_file) -> a YOLO folder: images a.png (100x80) and b.png (60x60),
    ``labels`` maps an image stem to its label file's text."""

    def make(labels: dict[str, str], names: tuple[str, str] = (
            "data.yaml", "names: [square, circle]\n")) -> Path:
        folder = tmp_path / "yolo"
        write_png(folder / "images" / "a.png", 100, 80)
        write_png(folder / "images" / "b.png", 60, 60)
        (folder / "labels").mkdir(parents=True)
        for stem, text in labels.items():
            (folder / "labels" / f"{stem}.txt").write_text(text)
        (folder / names[0]).write_text(names[1])
        return folder

    return make
