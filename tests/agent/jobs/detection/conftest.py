"""A device for the detector job tests: an upstream SSDlite trained once per session on the
clean synthetic detection set, published signed as ``det@v1`` to a registry served over
loopback HTTP, and the device's data, the same set seen through its camera (inverted), as a
COCO folder (``scripts/make_detection_data.py --camera invert``).

Small on purpose (64 px, half-width MobileNetV3, two dozen images, a few steps): the tests are
about the job's path (pull, plan, fine-tune, stage, health by mAP, commit or rollback), not
about how good a detector gets; ``benchmarks/detection.py`` measures that at 320 px.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.agent.jobs.conftest import REPO, Device, make_keys, publish_v1
from tests.support.built_once import built_once
from tests.support.registry_server import RegistryServer

SIZE = 64
MODEL = {"name": "torchvision/ssdlite320_mobilenet_v3_large", "image_size": SIZE,
         "kwargs": {"width_mult": 0.5, "detections_per_img": 100, "topk_candidates": 100}}
"""SSDlite at half width (1.1 M parameters): of the detectors a Jetson runs, the one that
trains fastest on a CPU; 100 detections per image keep pycocotools quick."""
CAMERAS = ["invert"]
"""The device's camera against the upstream's clean images."""


def build_detector_template(root: Path, *, upstream_images: int = 16, upstream_steps: int = 200,
                            device_images: int = 24) -> Path:
    """Upstream detector (``root/up``), the device's COCO folder (``root/cam0``), upstream and
    device keys under ``root``."""
    cfg = {
        "task": "detection",
        "run": {"name": "det-upstream", "output_dir": str(root / "up"), "seed": 0},
        "data": {"source": "synthetic_detection", "image_size": SIZE, "val_fraction": 0.25,
                 "synthetic": {"images": upstream_images, "size": SIZE, "seed": 0}},
        "model": MODEL,
        "optimizer": {"name": "adamw", "lr": 0.005, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 0, "decay": "cosine"},
        "training": {"global_batch_size": 8, "max_steps": upstream_steps, "device": "cpu",
                     "precision": "fp32", "grad_clip_norm": 10.0},
        "checkpoint": {"every_steps": None, "best_metric": None},
        "logging": {"progress": "off", "log_every_steps": 20},
        "faults": {"handle_signals": False},
    }
    code = f"""
from pathlib import Path
from hpc_core.config import config_from_dict
from hpc_core.tasks.detection.synthetic import write_synthetic
from hpc_core.trainer import Trainer
root = Path({str(root)!r})
Trainer(config_from_dict({cfg!r})).train()
write_synthetic(root / "cam0", {device_images}, {SIZE}, seed=0, cameras={CAMERAS!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return make_keys(root)


@dataclass
class DetectorDevice(Device):
    """A device whose model ``det`` is a detector."""

    model: ClassVar[str] = "det"

    def base_spec(self) -> dict[str, Any]:
        """The detector job the tests run: no export (``test_detection_export_job`` turns it
        on), paced by the
        simulated board of the Orin Nano 8 GB profile, within that profile's budget; the
        micro-batch given (no probes)."""
        return {
            "model": self.model, "version": "v1", "registry": self.registry.url,
            "data": str(self.data),
            "finetune": {"profile": "jetson-orin-nano-8gb", "sensors": "sim",
                         "trainable": "all", "steps": 4, "effective_batch": 4,
                         "micro_batch": 4, "lr": 0.001, "checkpoint_every": 2,
                         "val_fraction": 0.25},
            "steps": {"export": False},
        }


@pytest.fixture(scope="session")
def detector_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained once per run (~30 s of CPU), shared by the test processes: read only."""
    return built_once(tmp_path_factory, "detector-template", build_detector_template)


@pytest.fixture(scope="session")
def detector_registry(detector_template: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[RegistryServer]:
    """det@v1 signed by the upstream key, served over loopback HTTP (uploads add to it)."""
    reg = tmp_path_factory.mktemp("det-registry")
    publish_v1(detector_template, reg, name="det")
    with RegistryServer(reg) as server:
        yield server


def make_detector_device(template: Path, registry: RegistryServer, root: Path
                         ) -> DetectorDevice:
    """A fresh device at ``root`` (keys only, nothing installed)."""
    import shutil

    shutil.copytree(template / "state", root / "state")
    return DetectorDevice(root, registry, template / "cam0", template / "up")


@pytest.fixture
def detector_device(detector_template: Path, detector_registry: RegistryServer,
                    tmp_path: Path) -> DetectorDevice:
    return make_detector_device(detector_template, detector_registry, tmp_path / "dev")
