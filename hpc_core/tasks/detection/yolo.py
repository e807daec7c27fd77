"""YOLO detection folders (the Ultralytics / Darknet layout), read and checked at the boundary.

    DIR/images[/SPLIT]/NAME.jpg|png    the images
    DIR/labels[/SPLIT]/NAME.txt        one object per line: ``class cx cy w h``, the centre and
                                       size normalized by the image's width and height
    DIR/data.yaml                      ``names:`` a list, or a map ``0: name``; or
    DIR/classes.txt                    one class name per line

An image without a label file, or with an empty one, has no objects (YOLO's background
images). Every problem is reported with its file and line number and the fix
(:class:`~.boxes.DetectionDataError`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from hpc_core.tasks.detection.boxes import (
    DetectionDataError,
    OnOutside,
    check_box,
    xyxy_to_yolo,
    yolo_to_xyxy,
)
from hpc_core.tasks.detection.records import DetectionSet, ImageRecord
from registry.atomic import make_dirs, write_bytes_atomic

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def _names_from_yaml(path: Path) -> list[str]:
    text = path.read_text()
    if not text.strip():
        raise DetectionDataError(str(path), ["the file is empty: add names: [class0, ...]"])
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DetectionDataError(str(path), [f"not YAML ({e}): fix the file"]) from None
    names = tree.get("names") if isinstance(tree, dict) else None
    if isinstance(names, dict):
        if sorted(names) != list(range(len(names))):
            raise DetectionDataError(str(path), [
                f"names: keys {sorted(names)} are not 0 .. {len(names) - 1}: number the "
                "classes from 0 without gaps"])
        names = [names[i] for i in range(len(names))]
    if not isinstance(names, list) or not names:
        raise DetectionDataError(str(path), [
            "names: missing or empty: add names: [class0, class1, ...] (or a map 0: class0)"])
    nc = tree.get("nc")
    if nc is not None and nc != len(names):
        raise DetectionDataError(str(path), [
            f"nc: {nc} but names has {len(names)} entries: make them agree"])
    return [str(n) for n in names]


def read_class_names(folder: Path) -> list[str]:
    """The class names of a YOLO folder: ``data.yaml``'s ``names``, else ``classes.txt``."""
    for name in ("data.yaml", "dataset.yaml"):
        if (folder / name).is_file():
            return _names_from_yaml(folder / name)
    path = folder / "classes.txt"
    if path.is_file():
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not names:
            raise DetectionDataError(str(path), [
                "the file is empty: write one class name per line"])
        return names
    raise DetectionDataError(str(folder), [
        "no data.yaml and no classes.txt: add one naming the classes"])


def _parse_label_file(
    path: Path, width: int, height: int, num_classes: int, on_outside: OnOutside,
    problems: list[str],
) -> tuple[list[np.ndarray], list[int]]:
    boxes: list[np.ndarray] = []
    labels: list[int] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        where = f"{path}:{n}"
        if len(fields) != 5:
            extra = (" (a segment polygon? only boxes are read)" if len(fields) > 5 else "")
            problems.append(f"{where}: expected 5 fields 'class cx cy w h', got "
                            f"{len(fields)}{extra}: fix the line")
            continue
        try:
            cls = int(fields[0])
            values = np.array([float(v) for v in fields[1:]])
        except ValueError:
            problems.append(f"{where}: {line.strip()!r} is not 'class cx cy w h' (an integer "
                            "class and four numbers): fix the line")
            continue
        if not 0 <= cls < num_classes:
            problems.append(f"{where}: class {cls} is not in 0 .. {num_classes - 1} (the "
                            "names in data.yaml/classes.txt): fix the class or add the name")
            continue
        box, problem = check_box(yolo_to_xyxy(values, width, height)[0], width, height,
                                 on_outside)
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        assert box is not None
        boxes.append(box)
        labels.append(cls)
    return boxes, labels


def load_yolo(
    folder: Path, *, split: str | None = None, on_outside: OnOutside = "refuse"
) -> DetectionSet:
    """A YOLO detection folder (``split``: the sub-folder of ``images/`` and ``labels/``, e.g.
    ``train``), checked: raises :class:`DetectionDataError` listing every problem. Image ids
    are 1, 2, ... in file-name order."""
    from PIL import Image, UnidentifiedImageError

    folder = Path(folder)
    names = read_class_names(folder)
    images_dir = folder / "images" / (split or "")
    labels_dir = folder / "labels" / (split or "")
    if not images_dir.is_dir():
        raise DetectionDataError(str(folder), [
            f"no folder {images_dir}: put the images there"])
    files = sorted(p for p in images_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    problems: list[str] = []
    records = []
    for image_id, path in enumerate(files, start=1):
        try:
            with Image.open(path) as im:
                width, height = im.size
        except (UnidentifiedImageError, OSError) as e:
            problems.append(f"{path}: not a readable image ({e}): replace or remove it")
            continue
        label_path = labels_dir / f"{path.stem}.txt"
        boxes, labels = ([], [])
        if label_path.is_file():
            boxes, labels = _parse_label_file(label_path, width, height, len(names),
                                              on_outside, problems)
        records.append(ImageRecord(
            image_id=image_id, file_name=path.name, width=width, height=height,
            boxes=(np.stack(boxes) if boxes else np.zeros((0, 4))).astype(np.float32),
            labels=np.array(labels, dtype=np.int64)))
    stems = {p.stem for p in files}
    if labels_dir.is_dir():
        problems += [f"{p}: no image {p.stem}.* in {images_dir}: add the image or remove the "
                     "label file" for p in sorted(labels_dir.glob("*.txt")) if p.stem not in stems]
    if problems:
        raise DetectionDataError(str(folder), problems)
    return DetectionSet(images_dir, names, records)


def write_yolo(folder: Path, dataset: DetectionSet) -> Path:
    """Write ``folder/labels/*.txt`` (one per image, empty when it has no objects) and
    ``folder/data.yaml`` for ``dataset`` (atomically, 0600); the images are expected under
    ``folder/images`` already. Crowd regions have no YOLO form and are left out."""
    labels_dir = make_dirs(Path(folder) / "labels")
    for r in dataset.records:
        keep = ~r.iscrowd
        rows = xyxy_to_yolo(r.boxes[keep], r.width, r.height)
        text = "".join(f"{int(c)} " + " ".join(f"{v:.6f}" for v in row) + "\n"
                       for c, row in zip(r.labels[keep], rows, strict=True))
        write_bytes_atomic(labels_dir / f"{Path(r.file_name).stem}.txt", text.encode())
    data = {"path": ".", "train": "images", "val": "images",
            "nc": len(dataset.class_names), "names": list(dataset.class_names)}
    path = Path(folder) / "data.yaml"
    write_bytes_atomic(path, yaml.safe_dump(data, sort_keys=False).encode())
    return path
