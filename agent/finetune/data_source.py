"""Which ``data.source`` a device's data path is, for the model's task: the job names a path
(config-rooted: ``data: cam0`` is ``data_root/cam0``), the model's task the sources it may be
(``hpc_core.tasks``: an image folder or an .npz for a classifier, a COCO or a YOLO folder for
a detector), and the folder's layout picks one. Torch-free: the daemon's job models and the
worker use it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hpc_core.tasks import task_spec


def _coco(p: Path) -> bool:
    return p.is_dir() and ((p / "annotations.json").is_file()
                           or any((p / "annotations").glob("instances_*.json")))


def _yolo(p: Path) -> bool:
    return p.is_dir() and any((p / n).is_file()
                              for n in ("data.yaml", "dataset.yaml", "classes.txt"))


LAYOUTS: dict[str, tuple[Callable[[Path], bool], str]] = {
    "image_folder": (Path.is_dir, "a folder of class sub-folders (PNG/JPEG)"),
    "npz": (Path.is_file, "an .npz file with x and y"),
    "coco": (_coco, "a COCO folder (annotations.json or annotations/instances_*.json, "
                    "images/)"),
    "yolo": (_yolo, "a YOLO folder (images/, labels/, data.yaml)"),
}
"""Each path-backed source: whether a path has its layout, and how people call it."""


def data_source(path: Path, task: str) -> str:
    """The first of ``task``'s sources whose layout ``path`` has; ValueError saying what the
    task reads otherwise."""
    wanted = [s for s in task_spec(task).sources if s in LAYOUTS]
    for source in wanted:
        if LAYOUTS[source][0](path):
            return source
    kinds = "; or ".join(LAYOUTS[s][1] for s in wanted)
    raise ValueError(f"data {path}: a {task} model trains on {kinds}; {path} is none of these")


def annotated_folder(path: Path) -> bool:
    """A folder whose labels are files beside its images (COCO, YOLO), not sub-folder names:
    those files are part of the data set's identity."""
    return _coco(path) or _yolo(path)
