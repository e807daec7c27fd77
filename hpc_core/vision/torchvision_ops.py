"""torchvision's compiled operators, or a pure-torch stand-in where they cannot load.

PyPI's Linux torchvision wheels are built against CUDA torch: on a CPU-only torch build (this
project's CI and upstream hosts) their ``_C.so`` fails to load (it needs ``libc10_cuda.so``),
and ``import torchvision`` then dies in ``torchvision._meta_registrations``, which registers
fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` without checking that the
operators exist. Only those two are registered unguarded; every other op (roi_align, ...) is
skipped when the library is absent, and a model that uses one fails with torchvision's own
"Couldn't load custom C++ ops" error.

:func:`import_torchvision` is the one way this project imports torchvision (timm included,
:func:`import_timm`): when the compiled library loads, nothing is changed; when it cannot, it
defines the two schemas with :mod:`torch.library` before torchvision is imported, implements
``nms`` on CPU in pure torch (:func:`nms_reference`, the same semantics as torchvision's
kernel) and makes ``qnms`` raise a clear error, and says why once in the log. The detectors
this project builds (SSDlite, FCOS, RetinaNet) need nothing else from the compiled library.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

log = logging.getLogger("hpc_core.vision")

_lock = threading.Lock()
_shim_reason: str | None = None
"""Why the compiled ops did not load (None: they did, or torchvision was not imported yet)."""
_library: Any = None  # the torch.library.Library that holds the stand-in schemas: kept alive


NMS_ROWS = 1024
"""Rows of the IoU matrix computed at once (float64): bounds the memory of a large call."""


def nms_reference(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression, as ``torchvision.ops.nms`` computes it.

    Boxes ``(N, 4)`` in ``x1, y1, x2, y2``; visited by decreasing score (a stable sort, so
    ties keep their input order as torchvision's CPU kernel does); a box is dropped when its
    IoU with a kept box is strictly above ``iou_threshold``. Returns the kept indices, int64,
    by decreasing score.

    The IoU test is vectorised (``over[i, j]``: box ``i``, the higher score, would suppress
    box ``j``), in blocks of :data:`NMS_ROWS` rows, above the diagonal; the greedy pass that
    follows walks the boxes in numpy, one boolean OR per kept box: O(N^2) at worst,
    milliseconds for the thousands of candidates a detector's evaluation gives it.
    """
    if boxes.dim() != 2 or boxes.size(-1) != 4:
        raise ValueError(f"boxes should be a (N, 4) tensor, got {tuple(boxes.shape)}")
    if scores.dim() != 1 or scores.size(0) != boxes.size(0):
        raise ValueError(f"scores should be a ({boxes.size(0)},) tensor, got {tuple(scores.shape)}")
    n = boxes.size(0)
    if n == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes.to(torch.float64)[order]
    x1, y1, x2, y2 = b.unbind(1)
    area = (x2 - x1) * (y2 - y1)
    # Only a higher-scored box suppresses: each block of rows needs the columns from its
    # own first row on (the rest stays False), half the matrix.
    over = torch.zeros((n, n), dtype=torch.bool, device=boxes.device)
    for r in range(0, n, NMS_ROWS):
        s, c = slice(r, r + NMS_ROWS), slice(r, n)
        iw = (torch.minimum(x2[s, None], x2[None, c])
              - torch.maximum(x1[s, None], x1[None, c])).clamp_(min=0)
        ih = (torch.minimum(y2[s, None], y2[None, c])
              - torch.maximum(y1[s, None], y1[None, c])).clamp_(min=0)
        inter = iw.mul_(ih)
        # 0/0 (two zero-area boxes) is NaN in torchvision's kernel too, and NaN > t is False.
        over[s, c] = inter / (area[s, None] + area[None, c] - inter) > iou_threshold
    rows = over.cpu().numpy()
    suppressed = np.zeros(n, dtype=bool)
    keep: list[int] = []
    for i in range(n):
        if not suppressed[i]:
            keep.append(i)
            suppressed |= rows[i]
    return order[torch.tensor(keep, dtype=torch.int64, device=boxes.device)]


def _qnms_refused(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    raise RuntimeError(
        "torchvision::qnms (NMS on quantized boxes) needs torchvision's compiled operators, "
        f"which did not load here ({_shim_reason}); dequantize the boxes and use nms"
    )


def _compiled_library() -> Path | None:
    """torchvision's ``_C`` extension, located without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for candidate in sorted(Path(folder).glob("_C*.so")) + sorted(Path(folder).glob("_C*.pyd")):
            return candidate
    return None


def _define_stand_ins(reason: str) -> None:
    global _library, _shim_reason
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("nms", nms_reference, "CPU")
    lib.impl("qnms", _qnms_refused, "CPU")
    _library, _shim_reason = lib, reason


def compiled_ops_missing() -> str | None:
    """Why torchvision's compiled operators are not in use (None when they are)."""
    return _shim_reason


def import_torchvision() -> ModuleType:
    """``import torchvision``, with the CPU stand-ins above where its compiled ops cannot load.

    Raises ImportError with the install command when torchvision is not installed.
    """
    with _lock:
        if "torchvision" not in _loaded():
            _prepare()
        import torchvision
        if _shim_reason is not None:
            # torchvision.ops.nms asserts the whole compiled library is there before it
            # calls torch.ops.torchvision.nms; the stand-in above answers that one op.
            import torchvision.ops.boxes as boxes

            boxes._assert_has_ops = _assert_nms_stand_in
        return torchvision


def _assert_nms_stand_in() -> None:
    """What ``torchvision.ops.boxes`` checks before nms (and rotated box IoU): here nms has
    its stand-in, rotated IoU has none and says so."""
    if not hasattr(torch.ops.torchvision, "box_iou_rotated"):
        caller = sys._getframe(1).f_code.co_name
        if caller != "nms":
            raise RuntimeError(
                f"torchvision.ops.{caller} needs torchvision's compiled operators, which did "
                f"not load here ({_shim_reason})"
            )


def _loaded() -> set[str]:
    return set(sys.modules)


def _prepare() -> None:
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError(
            "torchvision is not installed: pip install -e '.[vision]' (it resolves the "
            "torchvision release that matches the installed torch)"
        )
    path = _compiled_library()
    if path is None:
        reason = "torchvision ships no compiled _C library"
    else:
        try:
            torch.ops.load_library(str(path))
            return
        except (OSError, RuntimeError) as e:
            reason = f"{path.name} does not load against torch {torch.__version__}: {e}"
    _define_stand_ins(reason)
    log.warning("torchvision's compiled operators are unavailable (%s); nms runs as a "
                "pure-torch CPU stand-in, qnms raises", reason)


def import_timm() -> ModuleType:
    """``import timm``, after torchvision (which timm imports) went through
    :func:`import_torchvision`."""
    import_torchvision()
    if importlib.util.find_spec("timm") is None:
        raise ImportError("timm is not installed: pip install -e '.[vision]'")
    import timm

    return timm
