"""The INT8 recipe: how activations and weights are quantized, chosen per target and host.

Two recipes, both documented by ONNX Runtime's quantization guide, both per-channel int8
weights along the output channels, biases in float:

- ``s8s8-symmetric``: int8 activations and weights, every zero-point 0. TensorRT's explicit
  quantization takes nothing else, and ONNX Runtime runs it fast where int8 products
  accumulate without saturation (x86 with VNNI, 64-bit ARM).
- ``u8s8-reduce-range``: uint8 activations (asymmetric, the whole 0..255 range used) and
  weights in [-64, 64] (ONNX Runtime's ``reduce_range``). On x86 without VNNI, ONNX Runtime's
  fast u8 x s8 kernel adds pairs of products in a saturating 16-bit lane; 255 x 64 x 2 =
  32,640 fits in it, 255 x 127 x 2 does not. This is the recipe ONNX Runtime recommends for
  AVX2/AVX-512 hosts without VNNI.

Either file is *correct* on every host, because every session the project builds asks ONNX
Runtime for its non-saturating kernel where the fast one could overflow
(``exporters.ort_runner``); the recipe decides how *fast* the correct answer comes: an
s8s8 file on an AVX2-only host runs on the slower u8 x u8 kernel (~1.1x FP32 on small_cnn
instead of ~1.7x for u8s8-reduce-range, ``benchmarks/export.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exporters.cpu_isa import CpuIsa

RecipeName = Literal["s8s8-symmetric", "u8s8-reduce-range"]
RecipeChoice = Literal["auto", "s8s8-symmetric", "u8s8-reduce-range"]


@dataclass(frozen=True)
class Int8Recipe:
    name: RecipeName
    reason: str
    """Why this recipe, in words: the target and the host's ISA."""

    @property
    def activations_signed(self) -> bool:
        return self.name == "s8s8-symmetric"

    @property
    def reduce_range(self) -> bool:
        return self.name == "u8s8-reduce-range"

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "reason": self.reason}


def choose_recipe(target: str, isa: CpuIsa, choice: RecipeChoice = "auto") -> Int8Recipe:
    """The recipe for an artefact served by ``target`` on a host with ``isa``."""
    if target == "tensorrt":
        if choice == "u8s8-reduce-range":  # ExportJob refuses this too; a direct caller may not
            raise ValueError("int8_recipe=u8s8-reduce-range cannot build a TensorRT engine: "
                             "TensorRT takes symmetric int8 only (use auto or s8s8-symmetric)")
        return TENSORRT_RECIPE
    if choice != "auto":
        return Int8Recipe(choice, f"set by int8_recipe on {isa.label}")
    if isa.int8_dot:
        return Int8Recipe("s8s8-symmetric",
                          f"{isa.label}: int8 products accumulate without saturation")
    if isa.arch == "x86_64":
        return Int8Recipe("u8s8-reduce-range",
                          f"{isa.label}: weights in [-64, 64] keep the fast u8 x s8 kernel exact")
    return Int8Recipe("s8s8-symmetric", f"{isa.label}: no saturating int8 kernel known")


TENSORRT_RECIPE = Int8Recipe("s8s8-symmetric", "target tensorrt: symmetric int8 only")
"""What every TensorRT-bound file is quantized with (and what ``qdq_check`` checks by default)."""
