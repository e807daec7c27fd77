"""Typed training configuration: pydantic v2 models, YAML on disk, ``--set a.b=c`` overrides.

Unknown keys are errors everywhere (``extra="forbid"``), and every error is reported with its
dotted field path and a hint (:func:`registry.validation.format_errors`). The ``model`` section
is the registry's model spec (:class:`registry.model_config.ModelConfig`): a manifest carries
the very same type.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from hpc_core.tasks import TASKS, TaskName, task_spec
from hpc_core.tasks.detection.synthetic_config import SyntheticDetectionConfig
from registry.model_config import ModelConfig
from registry.validation import StrictModel, field_docs, format_errors


class RunConfig(StrictModel):
    name: str = "run"
    """Run name, used in logs and as the MLflow run name."""
    output_dir: Path = Path("runs/default")
    """Where metrics.jsonl and checkpoints/ are written."""
    seed: int = 0
    """Seeds python, numpy and torch; the data order is derived from it too."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): slower on GPU, needed for bitwise repeats there."""


class DataConfig(StrictModel):
    source: Literal["digits", "image_folder", "npz", "coco", "yolo", "synthetic_detection"] = (
        "digits")
    """Classification: digits: sklearn's bundled 8x8 handwritten digits (1,797 images, no
    download); image_folder: one sub-folder of PNG/JPEG per class; npz: arrays `x` (N,C,H,W
    or N,H,W) and `y`.
    Detection (task: detection): coco: a folder with annotations.json (or
    annotations/instances_SPLIT.json) and images/; yolo: a folder with images/, labels/ and
    data.yaml; synthetic_detection: digits and shapes drawn in memory (data.synthetic)."""
    path: Path | None = None
    """Folder (image_folder, coco, yolo) or file (npz). Not used by digits and
    synthetic_detection."""
    image_size: int | None = Field(default=None, ge=4, le=1024)
    """Resize images to this many pixels square (digits: 8 natively, 32 is common).
    Detection: letterbox every image to this square (aspect kept, boxes moved with the
    pixels); null keeps each image's size (the detector resizes to model.image_size)."""
    synthetic: SyntheticDetectionConfig | None = None
    """synthetic_detection only: {images, size, seed, cameras}; null = the defaults."""
    split: str | None = None
    """coco/yolo: the part of the folder to train on, e.g. train: yolo reads images/SPLIT/
    and labels/SPLIT/, coco annotations/instances_SPLIT.json with images/SPLIT/ (or SPLIT/,
    or images/). null: the folder as a whole."""
    val_split: str | None = None
    """coco/yolo: the part to evaluate on, e.g. val (as data.split). null: hold out
    data.val_fraction of the training part."""
    boxes_outside: Literal["refuse", "clip"] = "refuse"
    """coco/yolo: a box reaching more than a pixel past its image is refused (the load fails
    listing each one) or clipped to the image."""
    grayscale: bool = True
    """image_folder only: load as 1-channel (True) or RGB (False)."""
    val_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    """Share of samples held out for evaluation, split deterministically by split_seed."""
    split_seed: int = 0
    """Seed of the train/validation split (kept apart from run.seed so splits stay fixed)."""
    num_workers: int = Field(default=0, ge=0)
    """DataLoader worker processes (0 = load in the training process)."""
    pin_memory: bool = False
    """Page-locked host batches for faster host-to-GPU copies."""
    prefetch_factor: int | None = Field(default=None, ge=1)
    """Batches each worker loads ahead; needs num_workers > 0."""
    persistent_workers: bool = False
    """Keep workers alive across epochs; needs num_workers > 0."""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source not in ("digits", "synthetic_detection") and self.path is None:
            raise ValueError(
                f"data.path is required for source={self.source!r}: set it to the "
                f"{'.npz file' if self.source == 'npz' else 'folder'}"
            )
        if self.synthetic is not None and self.source != "synthetic_detection":
            raise ValueError(f"data.synthetic is set but data.source={self.source!r} does "
                             "not read it: remove it, or set data.source=synthetic_detection")
        folder_only = [f"data.{k}" for k in ("split", "val_split")
                       if getattr(self, k) is not None]
        if self.boxes_outside != "refuse":
            folder_only.append("data.boxes_outside")
        if folder_only and self.source not in ("coco", "yolo"):
            raise ValueError(f"{', '.join(folder_only)}: only coco and yolo folders have "
                             f"these, not data.source={self.source!r}: remove them")
        if self.num_workers == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            raise ValueError("prefetch_factor and persistent_workers need data.num_workers > 0")
        return self


class OptimizerConfig(StrictModel):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-3, gt=0.0)
    """Peak learning rate, reached at the end of warm-up."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW only."""
    eps: float = Field(default=1e-8, gt=0.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """SGD only."""
    nesterov: bool = False
    """SGD only; needs momentum > 0."""

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ValueError("nesterov needs optimizer.name=sgd and optimizer.momentum > 0")
        return self


class ScheduleConfig(StrictModel):
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up from 0 to optimizer.lr over this many optimizer steps."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warm-up, down to min_lr_ratio * lr at the last step."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)


class EarlyStoppingConfig(StrictModel):
    patience: int | None = Field(default=None, ge=1)
    """Stop after this many evaluations without improvement (null = never stop early)."""
    metric: str = "eval/acc"
    """An evaluation metric of the task; left out, the task's gate metric (eval/acc for
    classification, eval/map for detection)."""
    mode: Literal["max", "min"] = "max"
    min_delta: float = Field(default=0.0, ge=0.0)


class TrainingConfig(StrictModel):
    global_batch_size: int = Field(default=64, ge=1)
    """Samples per optimizer step, summed over all ranks and micro-batches."""
    micro_batch_size: int | None = Field(default=None, ge=1)
    """Samples per forward/backward on one rank; the rest is gradient accumulation.
    null = global_batch_size / world_size (no accumulation)."""
    max_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to run; wins over epochs when both are set."""
    epochs: int | None = Field(default=None, ge=1)
    """Passes over the training split (used when max_steps is null)."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """fp16 uses a GradScaler; bf16 needs no scaling (Ampere/Orin, or CPU)."""
    proximal_mu: float = Field(default=0.0, ge=0.0)
    """FedProx's proximal term (Li et al. 2020), (mu / 2) * ||w - w_start||^2 over the
    trainable weights, w_start the weights training started from: keeps devices with unlike
    data from drifting apart before their updates are combined. 0 = off. Reported losses
    exclude it."""
    grad_clip_norm: float | None = Field(default=1.0, gt=0.0)
    """Clip the global gradient L2 norm to this (null = no clipping)."""
    channels_last: bool = False
    """Keep the model's 4-D weights, and so its activations, in NHWC memory order: oneDNN's
    faster convolutions on a CPU (a quarter less CPU per SSDlite step on an AVX-512 host).
    Checkpoints are written in the usual order either way."""
    eval_every_steps: int | None = Field(default=None, ge=1)
    """Evaluate every N optimizer steps (null = at the end of each epoch)."""
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set training.max_steps or training.epochs")
        if self.micro_batch_size is not None and self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) exceeds "
                f"global_batch_size ({self.global_batch_size})"
            )
        return self


class CheckpointConfig(StrictModel):
    every_steps: int | None = Field(default=None, ge=1)
    """Save every N optimizer steps (null = only at the end and on preemption)."""
    keep_last: int = Field(default=2, ge=1)
    """Step checkpoints kept; older ones are deleted (the best one is always kept)."""
    best_metric: str | None = "eval/acc"
    """Metric that picks the best checkpoint (null = no best tracking); left out, the task's
    gate metric (eval/acc for classification, eval/map for detection)."""
    best_mode: Literal["max", "min"] = "max"
    save_final: bool = True
    """Write checkpoints/final/ when training ends."""


class DistributedConfig(StrictModel):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto = nccl on CUDA, gloo on CPU."""
    timeout_s: int = Field(default=1800, ge=10)
    """Collective timeout; a rank stuck longer than this fails the job."""


class WandbConfig(StrictModel):
    project: str = "edgetrain"
    """W&B project the run is logged under."""
    mode: Literal["offline", "online"] = "offline"
    """offline: the run is written to output_dir/wandb/ only, no network (upload it later with
    `wandb sync`); online: streamed to the W&B server (needs `wandb login` or WANDB_API_KEY)."""


class LoggingConfig(StrictModel):
    log_every_steps: int = Field(default=10, ge=1)
    """Write train/* metrics every N optimizer steps."""
    progress: Literal["auto", "on", "off"] = "auto"
    """Progress bar: auto = only when stderr is a terminal."""
    tensorboard: bool = False
    """Also write TensorBoard events to output_dir/tb (needs the tracking extra)."""
    mlflow: bool = False
    """Also log to MLflow (needs the tracking extra)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI or server URL (null = a SQLite store in output_dir/mlflow.db)."""
    wandb: WandbConfig | None = None
    """Also log to Weights & Biases (needs the tracking extra): {project: edgetrain, mode:
    offline}; offline writes output_dir/wandb/ only (`wandb sync` uploads it later), online
    needs `wandb login`. null = off."""


class FaultConfig(StrictModel):
    max_nan_rollbacks: int = Field(default=3, ge=0)
    """Non-finite loss/grad norm: restore the last good checkpoint at most this many times."""
    nan_lr_scale: float = Field(default=0.1, gt=0.0, le=1.0)
    """Multiply the learning rate by this at each rollback."""
    min_micro_batch_size: int = Field(default=1, ge=1)
    """Out of memory: halve the micro-batch down to this, then give up."""
    handle_signals: bool = True
    """SIGTERM/SIGUSR1: checkpoint at the next step boundary and exit 0."""


class TrainConfig(StrictModel):
    task: TaskName = "classification"
    """What the model learns: classification (a class per image; eval/acc is the gate's
    metric) or detection (boxes, labels and scores from a torchvision detector; eval/map,
    COCO's mAP@0.5:0.95, is the gate's metric). Decides the data sources allowed, the loss
    and the metrics; model.task follows it (a config that sets only model.task, as a
    manifest's model spec does, takes the task from there)."""
    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    training: TrainingConfig = Field(default_factory=lambda: TrainingConfig(epochs=1))
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="before")
    @classmethod
    def _task_from_model(cls, data: Any) -> Any:
        # A config built around a manifest's model spec (a device's fine-tune) names the task
        # only there: the task follows it.
        if isinstance(data, dict) and "task" not in data:
            model = data.get("model")
            if isinstance(model, dict) and "task" in model:
                return {**data, "task": model["task"]}
        return data

    @model_validator(mode="after")
    def _task(self) -> TrainConfig:
        spec = task_spec(self.task)
        if self.data.source not in spec.sources:
            other = next(t.name for t in TASKS.values() if self.data.source in t.sources)
            raise ValueError(
                f"data.source={self.data.source!r} is {other} data, but task={self.task!r} "
                f"reads {', '.join(spec.sources)}: set data.source to one of those, or "
                f"task={other}")
        if "task" in self.model.model_fields_set and self.model.task != self.task:
            raise ValueError(f"model.task={self.model.task!r} disagrees with "
                             f"task={self.task!r}: set only the top-level task")
        self.model.task = self.task
        gate = f"eval/{spec.gate_metric}"
        for section, key in ((self.checkpoint, "best_metric"),
                             (self.training.early_stopping, "metric")):
            where = "checkpoint.best_metric" if key == "best_metric" else (
                "training.early_stopping.metric")
            if key not in section.model_fields_set:
                setattr(section, key, gate)  # the default follows the task
            elif getattr(section, key) not in (None, *spec.eval_metrics):
                raise ValueError(
                    f"{where}={getattr(section, key)!r}: task {self.task} reports "
                    f"{', '.join(spec.eval_metrics)}: use one of those")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """sha256 of the canonical JSON form: identifies a training config."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false, so `progress: off` stays a string."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


class ConfigError(Exception):
    """A config that does not validate; ``str()`` lists every error with its path and a hint."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: {len(errors)} error(s)\n" + "\n".join(errors))


# ---------------------------------------------------------------------------------------------
# Loading, overrides, errors


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides; values are parsed as YAML (``3``, ``true``, ``[1, 2]``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                "--set", [f"  {item!r}: expected KEY=VALUE, e.g. training.max_steps=100"]
            )
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError("--set", [f"  {key}: {part!r} is a value, not a section"])
            node = child
        node[parts[-1]] = parse_yaml(raw) if raw.strip() else None
    return tree


def _duplicate_keys(node: yaml.Node, path: str = "") -> list[str]:
    """Every key given twice in one mapping (YAML would silently keep the last), by path."""
    found: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = str(key.value)
            where = f"{path}.{name}" if path else name
            if name in seen:
                found.append(f"  {where}: duplicate key (line {key.start_mark.line + 1}): "
                             "keep one")
            seen.add(name)
            found += _duplicate_keys(value, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{path}[{i}]")
    return found


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML 1.2 mapping from ``path``; refuses empty files and duplicate keys."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(str(path), [f"  cannot read: {e.strerror}"]) from e
    try:
        duplicates = _duplicate_keys(yaml.compose(text, Loader=_Loader))
        tree = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(str(path), [f"  not valid YAML: {e}"]) from e
    if duplicates:
        raise ConfigError(str(path), duplicates)
    if tree is None:
        raise ConfigError(str(path), ["  (top level): the file is empty or only comments"])
    if not isinstance(tree, dict):
        raise ConfigError(str(path), [f"  top level must be a mapping, got {type(tree).__name__}"])
    return tree


def load_config(path: Path | str | None, overrides: list[str] | None = None) -> TrainConfig:
    tree = read_yaml(Path(path)) if path is not None else {}
    return config_from_dict(
        apply_overrides(tree, overrides or []), source=str(path or "<defaults>")
    )


def config_from_dict(tree: dict[str, Any], source: str = "<dict>") -> TrainConfig:
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(source, format_errors(e, TrainConfig)) from None


def summarize(cfg: TrainConfig) -> str:
    """The resolved config as YAML, for `hpc-train validate`."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)


def reference_markdown(root: type[BaseModel] = TrainConfig) -> str:
    """The config reference as Markdown tables, one per section (printed by config-docs)."""
    out = []
    defaults = TrainConfig(training=TrainingConfig(epochs=1)).to_dict()
    top = {k: f for k, f in root.model_fields.items()
           if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))}
    if top:
        out += ["### top level", "", "| key | default | meaning |", "|---|---|---|"]
        docs = field_docs(root)
        for name in top:
            desc = docs[name].replace("\n", " ").replace("|", "\\|")
            out.append(f"| `{name}` | `{json.dumps(defaults[name])}` | {' '.join(desc.split())} |")
        out.append("")
    for section, field in root.model_fields.items():
        if section in top:
            continue
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out += [f"### `{section}`", "", "| key | default | meaning |", "|---|---|---|"]
        docs = field_docs(model)
        for name in model.model_fields:
            default = defaults[section][name]
            desc = docs[name].replace("\n", " ").replace("|", "\\|")
            out.append(f"| `{name}` | `{json.dumps(default)}` | {' '.join(desc.split())} |")
        out.append("")
    return "\n".join(out)
