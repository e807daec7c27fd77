"""Registry manifests: what a published model version is made of.

A registry holds, per version, ``{name}/{version}/manifest.json`` + ``manifest.sig`` and a pool
of content-addressed chunks ``chunks/sha256/{h[:2]}/{h}`` shared by every version.

The bytes of a version form one logical *blob*: the concatenation of its chunks, in manifest
order. Every tensor and every artefact is one contiguous byte range of that blob, and the
ranges tile the blob exactly (no gap, no overlap, nothing smuggled in between); how the blob is
cut into chunks is :mod:`registry.chunks`.

``sequence`` gives the versions of one model a total order that the signature covers: the
publisher assigns 1, 2, 3, ... and a device refuses a sequence below the highest it ever
installed (a rollback attack serves an older, validly signed version). Version strings are
labels and are never compared.

The model spec is :class:`registry.model_config.ModelConfig`, the very type a training config
uses, with its sizes required to be resolved.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
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

from registry.errors import InvalidManifestError, UnsafeNameError
from registry.jsonsafe import loads_strict
from registry.model_config import ModelConfig
from registry.names import (
    check_artefact_path,
    check_model_name,
    check_sha256,
    check_tensor_name,
    check_version,
)
from registry.validation import format_errors

FORMAT = "edgetrain.manifest/1"
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused before parsing (a hostile server could send GBs)."""

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


def _as_pydantic(check: Any, value: str) -> str:
    """Run a name check inside a validator; from_bytes turns it back into UnsafeNameError."""
    try:
        return check(value)  # type: ignore[no-any-return]
    except UnsafeNameError as e:
        raise PydanticCustomError("unsafe_name", str(e)) from None



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class BaseRelease(_Strict):
    """An upstream release, by version and signed sequence: the one a device-made version
    descends from, or the one an aggregate's device fine-tunes were made from."""

    version: str
    sequence: int = Field(ge=1, le=(1 << 53))

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return check_version(v)


class AggregateInfo(_Strict):
    """The lineage of a version ``hpc-train aggregate`` made from device fine-tunes."""

    base: BaseRelease
    """The upstream release whose fine-tunes were combined (the deltas' reference)."""
    combined: tuple[str, ...] = Field(min_length=1)
    """The device versions combined, as the round's report lists them."""
    strategy: str = Field(min_length=1, max_length=64)
    """How the deltas were combined (fedavg, trimmed-mean, median, krum)."""
    report_sha256: str
    """sha256 of the round's aggregate.json, so the full report (per-update weights, norms,
    skips), wherever it is kept, can be tied to this version."""

    @field_validator("combined")
    @classmethod
    def _versions(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError("a combined version is listed twice")
        return tuple(check_version(x) for x in v)

    @field_validator("report_sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)


class TrainingData(_Strict):
    """What a device fine-tune learned from, by content, so every version a device makes
    names its data. Counts and a hash only: no sample leaves the device."""

    source: Literal["spool", "data_set"]
    """spool: a snapshot of the samples the device recorded (``agent.spool``); data_set: a
    folder of class sub-folders or an .npz the device keeps."""
    name: str = Field(min_length=1, max_length=255)
    """The spool's model, or the data set's name (its file or folder name, never a path)."""
    sha256: str
    """The snapshot's or .npz file's sha256; for a folder, sha256 over each image's
    ``class/file`` name and sha256 in sorted order (``agent.jobs.steps.finetune``)."""
    samples: int = Field(ge=0)
    pseudo_labelled: int = Field(default=0, ge=0)
    """Of the samples: labelled by the model itself (a spool's pseudo_label_threshold)."""

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str) -> str:
        if "/" in v or "\\" in v or any(ord(ch) < 32 for ch in v):
            raise ValueError(f"data name {v!r} must be a plain name, not a path")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)

    @model_validator(mode="after")
    def _counts(self) -> TrainingData:
        if self.pseudo_labelled > self.samples:
            raise ValueError(f"pseudo_labelled {self.pseudo_labelled} > samples {self.samples}")
        return self


class PretrainedWeights(_Strict):
    """The local weights file a training run started from (its config's model.weights)."""

    sha256: str
    """sha256 of the file, as pinned in the training config."""
    file: str = Field(min_length=1, max_length=255)
    """Its file name (no folder): a label for people; the sha256 is the identity."""

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        return check_sha256(v)

    @field_validator("file")
    @classmethod
    def _plain(cls, v: str) -> str:
        if "/" in v or "\\" in v or any(ord(c) < 32 for c in v):
            raise ValueError("a file name only, with no folder or control characters")
        return v


class LayoutRecord(_Strict):
    """The tensors the model spec builds, recorded at publish by building the module in torch:
    state-dict key -> [safetensors dtype, shape]. A device checks the version's tensors
    against it torch-free, for the models whose layout it cannot work out itself (torchvision,
    timm)."""

    built_from: ModelConfig
    """The spec the module was built from: the manifest's model, exactly."""
    built_with: str = Field(min_length=1, max_length=200)
    """The libraries that built it, e.g. 'torch 2.13.0, torchvision 0.28.0'."""
    tensors: dict[str, tuple[Dtype, tuple[int, ...]]] = Field(min_length=1)


class PersonalInfo(_Strict):
    """How a device made its personalized version of a release: the parts of its own model it
    kept in the release's weights (personalized serving)."""

    parts: tuple[Literal["head", "norm"], ...] = Field(min_length=1, max_length=2)
    """``head``: its own classifier (FedPer); ``norm``: its own normalization (FedBN)."""
    own_version: str = Field(min_length=1, max_length=128)
    """The device's version the parts came from (its active model when it took the release)."""


class TrainingInfo(_Strict):
    config_sha256: str | None = None
    """TrainConfig.digest() of the run that produced the weights."""
    step: int | None = None
    epoch: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    aggregate: AggregateInfo | None = None
    """Set when the weights are an aggregate of device fine-tunes; None for a training run."""
    data: TrainingData | None = None
    """Set on a device fine-tune: the data it learned from. Optional and left out of the
    signed bytes when None, so every manifest without it reads as before; a reader whose
    schema predates the field (unknown keys forbidden) refuses a manifest that has it."""
    pretrained: PretrainedWeights | None = None
    """The pretrained weights the run started from (model.weights of its config); None: it
    started from a random initialisation, or from a parent version. Left out when None."""
    personal: PersonalInfo | None = None
    """Set on a device's personalized version of a release: the release's weights with these
    parts of the device's own model in place. Left out when None."""


class Signer(_Strict):
    key_id: str
    """First 16 hex digits of sha256(raw Ed25519 public key)."""
    name: str
    """The key's name (file stem) as its owner called it, e.g. 'upstream' or a device id."""


class Manifest(_Strict):
    format: Literal["edgetrain.manifest/1"] = FORMAT
    name: str
    version: str
    sequence: int = Field(ge=1, le=(1 << 53))
    """Position in the model's release order, assigned by the publisher, covered by the
    signature; a device never installs a sequence below the highest it has installed."""
    parent: str | None = None
    """The version this one was derived from (fine-tuned from, or published after)."""
    base: BaseRelease | None = None
    """For a version a device made (a fine-tune, or a fine-tune of one): the upstream release
    its lineage starts from. None: an upstream release, its own base. Anti-rollback compares
    upstream releases by their own sequence, a device's versions within their base
    (``agent.storage.slots``), so a device that fine-tuned still takes the next release."""
    created_at: datetime
    signer: Signer
    model: ModelConfig
    """The model spec, as in a training config; sizes must be resolved."""
    training: TrainingInfo = Field(default_factory=TrainingInfo)
    layout: LayoutRecord | None = None
    """For a torchvision or timm model: the tensors its spec builds, recorded at publish; a
    device refuses a version whose tensors differ. Left out when None (the project's own
    models are checked from the spec alone)."""
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

    @field_validator("model")
    @classmethod
    def _resolved(cls, v: ModelConfig) -> ModelConfig:
        unset = [f for f in ("num_classes", "in_channels", "image_size") if getattr(v, f) is None]
        if unset:
            raise ValueError(
                f"model.{unset[0]} must be set: a device rebuilds the module from the spec alone"
            )
        if v.weights is not None:
            raise ValueError(
                "model.weights is a training input (a local file path): a manifest records "
                "its sha256 in training.pretrained instead"
            )
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

    @property
    def base_release(self) -> BaseRelease:
        """The upstream release this version's lineage starts from (itself, for one)."""
        return self.base or BaseRelease(version=self.version, sequence=self.sequence)

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
        if doc["base"] is None:  # an upstream release: the same bytes as before lineage existed
            del doc["base"]
        # Left out unless set, for the same reason: a device whose schema predates a field
        # (extra keys forbidden) still takes every version that does not set it.
        for optional in ("aggregate", "data", "pretrained", "personal"):
            if doc["training"][optional] is None:
                del doc["training"][optional]
        if doc["layout"] is None:
            del doc["layout"]
        else:
            doc["layout"]["built_from"].pop("weights", None)
            _drop_default_task(doc["layout"]["built_from"])
        doc["model"].pop("weights", None)  # always None here (_resolved)
        _drop_default_task(doc["model"])
        return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "manifest.json") -> Manifest:
        doc = loads_strict(data, source, max_bytes=MAX_MANIFEST_BYTES)  # MalformedJsonError
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


def _drop_default_task(spec: dict[str, Any]) -> None:
    """Leave a classifier's ``task`` out of the signed bytes: a classifier's manifest stays
    byte for byte what it was before the field existed, and a device whose schema predates
    it still takes every classifier."""
    if spec.get("task") == "classification":
        del spec["task"]


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)
