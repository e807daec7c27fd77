"""What a device fine-tune learned from, fixed once per job and signed into the version it
makes (``registry.manifest.TrainingData``).

The fine-tune step calls :func:`fix_training_data` when it first starts: a spool is
snapshot into the job's folder (``JOB_DIR/spool.npz``; a resumed job trains on that same
snapshot, however much was recorded since), a data set is hashed where it is. The record
(``JOB_DIR/data.json``) is what the stage and upload steps put in the manifest. Numpy only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from agent.finetune.data_source import annotated_folder
from agent.spool.config import is_spool
from agent.spool.snapshot import file_sha256
from agent.spool.store import Spool
from registry.atomic import write_bytes_atomic
from registry.manifest import TrainingData
from registry.publish import VersionContent

SNAPSHOT = "spool.npz"
"""JOB_DIR/spool.npz: the snapshot of a spool that the job trains on."""
DATA_RECORD = "data.json"
"""JOB_DIR/data.json: the job's :class:`TrainingData`, written once."""
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
"""The files hpc_core.data reads from a class folder (importing it would load torch here)."""


def fix_training_data(data: Path, job_dir: Path) -> TrainingData:
    """The job's training data, decided on its first call and read back on every later one."""
    path = job_dir / DATA_RECORD
    if path.is_file():
        return TrainingData.model_validate_json(path.read_bytes())
    if is_spool(data):
        with Spool.open(data) as spool:
            info = spool.snapshot(job_dir / SNAPSHOT)
        record = TrainingData(source="spool", name=data.name, sha256=info.sha256,
                              samples=info.samples, pseudo_labelled=info.pseudo_labelled)
    else:
        record = data_set_record(data)
    write_bytes_atomic(path, record.model_dump_json(indent=1).encode())
    return record


def read_training_data(job_dir: Path) -> TrainingData | None:
    """The job's record (None: a job that started before records existed)."""
    path = job_dir / DATA_RECORD
    return TrainingData.model_validate_json(path.read_bytes()) if path.is_file() else None


def training_data_path(data: Path, job_dir: Path) -> Path:
    """What the fine-tune reads: the job's snapshot for a spool, the data set otherwise."""
    record = read_training_data(job_dir)
    return job_dir / SNAPSHOT if record is not None and record.source == "spool" else data


def with_training_data(content: VersionContent, job_dir: Path) -> VersionContent:
    """``content`` whose manifest will name the job's training data (unchanged without a
    record)."""
    record = read_training_data(job_dir)
    if record is None:
        return content
    return dataclasses.replace(
        content, training=content.training.model_copy(update={"data": record}))


def data_set_record(path: Path) -> TrainingData:
    """A data set by content: an .npz file's sha256; a folder's, sha256 over every image's
    ``class/file`` name and sha256, sorted (the order hpc_core.data reads them in); a COCO or
    YOLO folder's, over every file's relative path and sha256 (its labels are files too),
    counting its images."""
    if annotated_folder(path):
        digest, samples = hashlib.sha256(), 0
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
            digest.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
            samples += f.suffix.lower() in IMAGE_SUFFIXES
        return TrainingData(source="data_set", name=path.name, sha256=digest.hexdigest(),
                            samples=samples)
    if path.is_dir():
        digest, samples = hashlib.sha256(), 0
        for cls in sorted(p for p in path.iterdir() if p.is_dir()):
            for f in sorted(cls.iterdir()):
                if f.suffix.lower() in IMAGE_SUFFIXES:
                    digest.update(f"{cls.name}/{f.name}\0{file_sha256(f)}\n".encode())
                    samples += 1
        return TrainingData(source="data_set", name=path.name, sha256=digest.hexdigest(),
                            samples=samples)
    with np.load(path, allow_pickle=False) as z:
        samples = len(z["y"])
    return TrainingData(source="data_set", name=path.name, sha256=file_sha256(path),
                        samples=samples)
