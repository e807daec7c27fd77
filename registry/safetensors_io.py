"""safetensors header I/O and pickle refusal.

A model file is read as a safetensors header (JSON, strictly parsed) plus byte ranges; tensor
data is never deserialized here. Anything shaped like a pickle (or a zip holding one, which is
``torch.save``'s format) is refused outright: loading it would run code.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.errors import MalformedJsonError, NotSafetensorsError, PickleRefusedError
from registry.jsonsafe import loads_strict
from registry.manifest import DTYPE_SIZES, TensorEntry

MAX_SAFETENSORS_HEADER = 100 << 20

# File suffixes whose formats are pickle containers, whatever their first bytes say.
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")



def pickle_kind(head: bytes) -> str | None:
    """Name the pickle container ``head`` (a file's first bytes) starts, or None."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a Python pickle (protocol {head[1]})"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (torch.save's format, which wraps a pickle)"
    return None


def refuse_pickled_file(path: Path, label: str) -> None:
    """Raise PickleRefusedError if ``path`` is a pickle or a zip holding one."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise PickleRefusedError(
            f"{label}: {path.suffix} files are pickle containers and are never loaded; "
            "export tensors as safetensors or the model as ONNX"
        )
    with open(path, "rb") as f:
        head = f.read(8)
    kind = pickle_kind(head)
    if kind is None:
        return
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as z:
                pickled = [n for n in z.namelist() if n.endswith((".pkl", ".pickle"))]
        except zipfile.BadZipFile:
            pickled = []
        if not pickled:
            return  # a plain zip (e.g. a bundle of engine files) is fine
        kind = f"a zip archive holding {pickled[0]} (torch.save format)"
    raise PickleRefusedError(
        f"{label} is {kind}; pickles run code when loaded and are never accepted"
    )


@dataclass(frozen=True)
class FileRange:
    path: Path
    start: int
    nbytes: int


@dataclass(frozen=True)
class TensorSource:
    """One tensor of a safetensors file: where its raw bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: FileRange


def read_safetensors_index(path: Path) -> list[TensorSource]:
    """Parse a safetensors header without loading tensors; refuse pickles and malformed files."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        kind = pickle_kind(head)
        if kind is not None:
            raise PickleRefusedError(
                f"{path} is {kind}, not safetensors; pickles run code when loaded and are refused. "
                "Re-save the weights with safetensors (hpc_core checkpoints already are)"
            )
        if len(head) < 8:
            raise NotSafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
        header_len = int.from_bytes(head, "little")
        if header_len > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise NotSafetensorsError(
                f"{path}: header length {header_len} is impossible for a {size}-byte file"
            )
        raw = f.read(header_len)
    try:
        header = loads_strict(raw, f"{path}: safetensors header")
    except MalformedJsonError as e:
        raise NotSafetensorsError(str(e)) from None
    if not isinstance(header, dict):
        raise NotSafetensorsError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    out: list[TensorSource] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise NotSafetensorsError(
                f"{path}: tensor {name!r} has a malformed header entry"
            ) from None
        if any(not isinstance(x, int) or isinstance(x, bool) or x < 0
               for x in (*shape, begin, end)):
            raise NotSafetensorsError(
                f"{path}: tensor {name!r} needs non-negative integer shape and data_offsets"
            )
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise NotSafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        want = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != want or begin < 0 or data_start + end > size:
            raise NotSafetensorsError(
                f"{path}: tensor {name!r} byte range [{begin}, {end}) does not fit "
                f"{dtype}{list(shape)} inside the file (truncated?)"
            )
        out.append(TensorSource(name, dtype, shape, FileRange(path, data_start + begin, want)))
    return out


def safetensors_header(tensors: Iterable[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding ``tensors`` back to back."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]
        }
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so tensor data stays 8-aligned
    return len(raw).to_bytes(8, "little") + raw
