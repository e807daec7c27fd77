"""Registry manifests: what a published model version is made of, and how its bytes are cut.

A registry holds, per version, ``{name}/{version}/manifest.json`` + ``manifest.sig`` and a pool
of content-addressed chunks ``chunks/sha256/{h[:2]}/{h}`` shared by every version.

The bytes of a version form one logical *blob*: the concatenation of its chunks, in manifest
order. Every tensor and every artefact is one contiguous byte range of that blob, and the
ranges tile the blob exactly (no gap, no overlap, nothing smuggled in between). The blob is
laid out by a fixed rule, so identical tensor bytes always give identical chunks:

1. tensors smaller than ``pack_below`` bytes, sorted by name, are packed into one segment
   (biases and norm statistics: thousands of tiny requests would cost more than they save);
2. every other tensor, sorted by name, is a segment of its own;
3. every artefact, sorted by path, is a segment of its own;

and each segment is cut into ``chunk_size`` pieces, the last one shorter. A chunk therefore
never spans two large tensors: a changed tensor changes only its own chunks, and re-publishing
an unchanged tensor gives chunk hashes the registry already holds.

Nothing here imports torch at module level: the device reads manifests before it needs torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hpc_core.config import format_errors

FORMAT = "edgetrain.manifest/1"
DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_PACK_BELOW = 64 << 10
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused before parsing (a hostile server could send GBs)."""
MAX_SAFETENSORS_HEADER = 100 << 20
CHUNK_PREFIX = "chunks/sha256"

# safetensors dtype names -> bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
Dtype = Literal[
    "BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "U16", "I16", "F16", "BF16",
    "U32", "I32", "F32", "U64", "I64", "F64",
]

# File suffixes whose formats are pickle containers, whatever their first bytes say.
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_TENSOR_PART_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_PATH_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------------------------------------
# Errors: one class per way a version is refused, so callers and tests can tell them apart.


class ManifestError(Exception):
    """A manifest, or the bytes it describes, was refused."""


class InvalidManifestError(ManifestError):
    """The manifest does not parse or is inconsistent (bad JSON, schema, ranges)."""


class UnsafeNameError(ManifestError):
    """A tensor name or artefact path could escape its slot (``..``, absolute, odd characters)."""


class PickleRefusedError(ManifestError):
    """A file is (or is shaped like) a Python pickle; those run code when loaded."""


class NotSafetensorsError(ManifestError):
    """A model file is not a well-formed safetensors file."""


class IntegrityError(ManifestError):
    """Bytes do not match the hashes or sizes the signed manifest promises."""


class ChunkHashError(IntegrityError):
    def __init__(self, message: str, sha256: str) -> None:
        super().__init__(message)
        self.sha256 = sha256


class TensorHashError(IntegrityError):
    """A tensor's bytes assembled from verified chunks still hash differently."""


class TruncatedError(IntegrityError):
    """A chunk or file is shorter than the manifest says."""


class SpecMismatchError(ManifestError):
    """Tensor names, dtypes or shapes differ from the module the model spec builds."""


# ---------------------------------------------------------------------------------------------
# Names


def _unsafe(kind: str, value: str, why: str) -> UnsafeNameError:
    return UnsafeNameError(f"{kind} {value!r} is refused: {why}")


def _as_pydantic(check: Callable[[str], str], value: str) -> str:
    """Run a name check inside a validator; from_bytes turns it back into UnsafeNameError."""
    try:
        return check(value)
    except UnsafeNameError as e:
        raise PydanticCustomError("unsafe_name", str(e)) from None


def check_tensor_name(name: str) -> str:
    """State-dict keys: dot-separated identifiers. Nothing that reads as a path survives."""
    if not name or len(name) > 512:
        raise _unsafe("tensor name", name, "must be 1-512 characters")
    if name == "__metadata__":
        raise _unsafe("tensor name", name, "reserved by the safetensors header")
    if any(not _TENSOR_PART_RE.match(part) for part in name.split(".")):
        raise _unsafe(
            "tensor name", name,
            "each dot-separated part must be letters, digits, '_' or '-' ('..', '/', absolute "
            "paths would escape the slot)",
        )
    return name


def check_artefact_path(path: str) -> str:
    """A relative POSIX path inside the slot's artefacts/ folder; no '..', no hidden files."""
    if not path or len(path) > 255 or path.startswith("/") or "\\" in path:
        raise _unsafe("artefact path", path, "must be a relative POSIX path of 1-255 characters")
    parts = path.split("/")
    if len(parts) > 8 or any(not _PATH_PART_RE.match(p) for p in parts):
        raise _unsafe(
            "artefact path", path,
            "each part must start with a letter, digit or '_' and use only [A-Za-z0-9_.-] "
            "(at most 8 parts); '..' and absolute paths would escape the slot",
        )
    return path


def check_model_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"model name {name!r} is invalid: use 1-64 of [a-z0-9._-], starting with a "
            "letter or digit"
        )
    return name


def check_version(version: str) -> str:
    if not _VERSION_RE.match(version):
        raise ValueError(
            f"version {version!r} is invalid: use 1-64 of [A-Za-z0-9._+-], starting with a letter "
            "or digit (no '/')"
        )
    return version


def check_sha256(value: str) -> str:
    if not _SHA256_RE.match(value):
        raise ValueError("must be 64 lower-case hex digits")
    return value


def chunk_key(sha256: str) -> str:
    """Where a chunk lives in a registry (two-hex fan-out keeps directories small)."""
    return f"{CHUNK_PREFIX}/{sha256[:2]}/{sha256}"


def manifest_key(name: str, version: str) -> str:
    return f"{name}/{version}/manifest.json"


def signature_key(name: str, version: str) -> str:
    return f"{name}/{version}/manifest.sig"


# ---------------------------------------------------------------------------------------------
# Schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """Everything ``hpc_core.models.build_model`` needs to rebuild the module."""

    name: str
    """Registry name (mlp, small_cnn, resnet, mobilenet_v2) or 'package.module:factory'."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    num_classes: int = Field(ge=1)
    in_channels: int = Field(ge=1)
    image_size: int = Field(ge=1)


class ChunkRef(_Strict):
    sha256: str
    size: int = Field(ge=1)
    """Bytes; at most the manifest's chunk_size."""

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)


class TensorEntry(_Strict):
    name: str
    dtype: Dtype
    shape: tuple[int, ...]
    offset: int = Field(ge=0)
    """Start of the tensor's bytes in the version's blob."""
    nbytes: int = Field(ge=0)
    sha256: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _as_pydantic(check_tensor_name, v)

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)

    @model_validator(mode="after")
    def _size(self) -> TensorEntry:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name}: negative dimension in shape {list(self.shape)}")
        want = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if want != self.nbytes:
            raise ValueError(
                f"tensor {self.name}: {self.dtype}{list(self.shape)} needs {want} bytes, "
                f"manifest says {self.nbytes}"
            )
        return self


class ArtefactEntry(_Strict):
    path: str
    """Relative path under the slot's artefacts/ folder, e.g. 'export/model.int8.onnx'."""
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    sha256: str

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _as_pydantic(check_artefact_path, v)

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)


class TrainingInfo(_Strict):
    config_sha256: str | None = None
    """TrainConfig.digest() of the run that produced the weights."""
    step: int | None = None
    epoch: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)


class Signer(_Strict):
    key_id: str
    """First 16 hex digits of sha256(raw Ed25519 public key)."""
    name: str
    """The key's name (file stem) as its owner called it, e.g. 'upstream' or a device id."""


class Manifest(_Strict):
    format: Literal["edgetrain.manifest/1"] = FORMAT
    name: str
    version: str
    parent: str | None = None
    """The version this one was derived from (fine-tuned from, or published after)."""
    created_at: datetime
    signer: Signer
    model: ModelSpec
    training: TrainingInfo = Field(default_factory=TrainingInfo)
    chunk_size: int = Field(ge=4096, le=1 << 30)
    pack_below: int = Field(ge=0)
    chunks: tuple[ChunkRef, ...]
    tensors: tuple[TensorEntry, ...]
    artefacts: tuple[ArtefactEntry, ...] = ()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_model_name(v)

    @field_validator("version", "parent")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        return None if v is None else check_version(v)

    @field_validator("created_at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("created_at needs a time zone (UTC, e.g. 2025-01-01T00:00:00Z)")
        return v

    @model_validator(mode="after")
    def _tiling(self) -> Manifest:
        for c in self.chunks:
            if c.size > self.chunk_size:
                raise ValueError(
                    f"chunk {c.sha256[:12]} has {c.size} bytes > chunk_size {self.chunk_size}"
                )
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"tensor {t.name!r} is listed twice")
            seen.add(t.name)
        paths = [a.path for a in self.artefacts]
        if len(set(paths)) != len(paths):
            raise ValueError("an artefact path is listed twice")
        total = self.total_bytes
        ranges = sorted(
            [(t.offset, t.nbytes, f"tensor {t.name}") for t in self.tensors]
            + [(a.offset, a.nbytes, f"artefact {a.path}") for a in self.artefacts]
        )
        pos = 0
        for offset, nbytes, what in ranges:
            if offset != pos:
                raise ValueError(
                    f"{what} starts at byte {offset}, expected {pos}: tensors and artefacts must "
                    "tile the blob with no gap or overlap"
                )
            pos += nbytes
        if pos != total:
            raise ValueError(f"tensors and artefacts cover {pos} bytes, the chunks hold {total}")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def chunk_offsets(self) -> list[int]:
        """Blob offset of each chunk's first byte."""
        out, pos = [], 0
        for c in self.chunks:
            out.append(pos)
            pos += c.size
        return out

    def to_bytes(self) -> bytes:
        """The exact bytes that get signed and stored. Verification never re-serializes."""
        doc = self.model_dump(mode="json")
        return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "manifest.json") -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise InvalidManifestError(
                f"{source}: {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
            )
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidManifestError(f"{source}: not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise InvalidManifestError(f"{source}: top level must be an object")
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            unsafe = [err for err in e.errors() if err["type"] == "unsafe_name"]
            if unsafe:
                raise UnsafeNameError(f"{source}: {unsafe[0]['msg']}") from None
            lines = "\n".join(format_errors(e, cls))
            raise InvalidManifestError(f"{source}: does not validate\n{lines}") from None


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


# ---------------------------------------------------------------------------------------------
# Pickles and safetensors files


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
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotSafetensorsError(f"{path}: header is not JSON: {e}") from None
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
        if dtype not in DTYPE_SIZES:
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


# ---------------------------------------------------------------------------------------------
# Layout: cutting tensors and artefacts into chunks


@dataclass(frozen=True)
class ArtefactSource:
    path: str
    data: FileRange


@dataclass(frozen=True)
class Layout:
    chunks: tuple[ChunkRef, ...]
    tensors: tuple[TensorEntry, ...]
    artefacts: tuple[ArtefactEntry, ...]


ChunkSink = Callable[[ChunkRef, bytes], None]
_READ_BLOCK = 1 << 20


def lay_out(
    tensors: Iterable[TensorSource],
    artefacts: Iterable[ArtefactSource] = (),
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pack_below: int = DEFAULT_PACK_BELOW,
    on_chunk: ChunkSink | None = None,
) -> Layout:
    """Cut tensors and artefacts into chunks by the module's rule, hashing as it reads.

    ``on_chunk(ref, data)`` sees every chunk in blob order (to upload the ones a registry
    lacks); memory stays at one chunk whatever the model size.
    """
    tensors = sorted(tensors, key=lambda t: t.name)
    arts = sorted(artefacts, key=lambda a: a.path)
    for t in tensors:
        check_tensor_name(t.name)
    for a in arts:
        check_artefact_path(a.path)
    # Segments of (key, bytes); key = ("t", tensor name) or ("a", artefact path).
    small = [(("t", t.name), t.data) for t in tensors if t.data.nbytes < pack_below]
    segments = [small] if small else []
    segments += [[(("t", t.name), t.data)] for t in tensors if t.data.nbytes >= pack_below]
    segments += [[(("a", a.path), a.data)] for a in arts]

    cutter = _Cutter(chunk_size, on_chunk)
    offsets: dict[tuple[str, str], int] = {}
    hashes: dict[tuple[str, str], str] = {}
    for segment in segments:
        for key, rng in segment:
            offsets[key] = cutter.position
            hashes[key] = cutter.feed(rng)
        cutter.end_segment()

    # Blob order, which is also the order tensors appear in an assembled safetensors file.
    tensor_entries = sorted(
        (
            TensorEntry(
                name=t.name, dtype=t.dtype, shape=t.shape,  # type: ignore[arg-type]
                offset=offsets["t", t.name], nbytes=t.data.nbytes, sha256=hashes["t", t.name],
            )
            for t in tensors
        ),
        key=lambda e: e.offset,
    )
    artefact_entries = [
        ArtefactEntry(path=a.path, offset=offsets["a", a.path], nbytes=a.data.nbytes,
                      sha256=hashes["a", a.path])
        for a in arts
    ]
    return Layout(tuple(cutter.chunks), tuple(tensor_entries), tuple(artefact_entries))


class _Cutter:
    """Accumulates bytes into chunk_size pieces; a segment end closes the current chunk."""

    def __init__(self, chunk_size: int, on_chunk: ChunkSink | None) -> None:
        self.chunk_size = chunk_size
        self.on_chunk = on_chunk
        self.chunks: list[ChunkRef] = []
        self.position = 0
        self._buf = bytearray()

    def feed(self, rng: FileRange) -> str:
        """Append a file range; return its sha256."""
        h = hashlib.sha256()
        with open(rng.path, "rb") as f:
            f.seek(rng.start)
            left = rng.nbytes
            while left:
                piece = f.read(min(left, self.chunk_size - len(self._buf), _READ_BLOCK))
                if not piece:
                    raise TruncatedError(f"{rng.path}: ends before byte {rng.start + rng.nbytes}")
                h.update(piece)
                self._buf += piece
                left -= len(piece)
                self.position += len(piece)
                if len(self._buf) == self.chunk_size:
                    self.end_segment()
        return h.hexdigest()

    def end_segment(self) -> None:
        if not self._buf:
            return
        data = bytes(self._buf)
        self._buf = bytearray()
        ref = ChunkRef(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        self.chunks.append(ref)
        if self.on_chunk is not None:
            self.on_chunk(ref, data)


def artefact_sources(root: Path, prefix: str = "") -> list[ArtefactSource]:
    """Every regular file under ``root`` as an artefact named ``prefix/relative/path``."""
    root = Path(root)
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            p = Path(dirpath) / fname
            if p.is_symlink() or not p.is_file():
                continue
            rel = p.relative_to(root).as_posix()
            name = f"{prefix}/{rel}" if prefix else rel
            out.append(ArtefactSource(name, FileRange(p, 0, p.stat().st_size)))
    return out


# ---------------------------------------------------------------------------------------------
# Model spec <-> tensors (torch needed from here on; imported lazily)


def torch_dtype_name(dtype: Any) -> str:
    import torch

    names = {
        torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
        torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32",
        torch.int64: "I64", torch.float64: "F64",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    }
    if dtype not in names:
        raise SpecMismatchError(f"dtype {dtype} has no safetensors name")
    return names[dtype]


def build_module(spec: ModelSpec, *, meta: bool = False, allow_custom: bool = True) -> Any:
    """Rebuild the module a spec describes; ``meta`` builds shapes only (no memory, no init)."""
    import torch

    from hpc_core.models import build_model

    if ":" in spec.name and not allow_custom:
        raise SpecMismatchError(
            f"model {spec.name!r} names a Python factory to import; refused unless custom models "
            "are allowed (agentctl pull --allow-custom-model)"
        )
    # Meta tensors carry shape and dtype only: checking a 10 GB spec costs no memory.
    where = torch.device("meta") if meta else contextlib.nullcontext()
    try:
        with where:
            return build_model(
                spec.name, num_classes=spec.num_classes, in_channels=spec.in_channels,
                image_size=spec.image_size, **spec.kwargs,
            )
    except ValueError as e:
        raise SpecMismatchError(f"model spec {spec.name!r} does not build: {e}") from None


def check_against_spec(manifest: Manifest, *, allow_custom: bool = False) -> None:
    """Tensor names, dtypes and shapes must be exactly those of the module the spec builds."""
    module = build_module(manifest.model, meta=True, allow_custom=allow_custom)
    want = {k: (torch_dtype_name(v.dtype), tuple(v.shape)) for k, v in module.state_dict().items()}
    have = {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors}
    problems = []
    for k in sorted(set(want) - set(have)):
        problems.append(f"missing tensor {k} ({want[k][0]}{list(want[k][1])})")
    for k in sorted(set(have) - set(want)):
        problems.append(f"unexpected tensor {k}")
    for k in sorted(set(want) & set(have)):
        if want[k] != have[k]:
            problems.append(
                f"tensor {k}: manifest has {have[k][0]}{list(have[k][1])}, "
                f"model {manifest.model.name} needs {want[k][0]}{list(want[k][1])}"
            )
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        shown = "; ".join(problems[:5]) + more
        raise SpecMismatchError(f"{manifest.ref} does not match its model spec: {shown}")
