"""``hpc-train evaluate``: a checkpoint's metrics on a validation split, through its task.

The model is rebuilt from the checkpoint's own config; the data is that config's (its
validation split, as training held it out) unless ``--config`` names another config whose
``data`` section to use, and ``--set`` changes fields of whichever is used (point
``data.path`` at another folder, ``data.val_split`` at another part). Prints one JSON line:
the checkpoint, its task, the samples scored and every ``eval/*`` metric (``null`` where
undefined, e.g. mAP without ground truth).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hpc_core.config import ConfigError, apply_overrides, config_from_dict, load_config


def add_evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its final/ "
                   "checkpoint, else its newest step_*/)")
    p.add_argument("--config", default=None, help="a YAML training config whose data section "
                   "to evaluate on (default: the checkpoint's own); its task must be the "
                   "checkpoint's")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of that config, e.g. data.path=other-set "
                   "(repeatable)")
    p.add_argument("--batch-size", type=int, default=32, metavar="N",
                   help="images per forward pass (default: 32)")


def run_evaluate(args: argparse.Namespace) -> int:
    from hpc_core.checkpoint import load_model
    from hpc_core.checkpoint_layout import CheckpointError, resolve_checkpoint
    from hpc_core.data import make_loader
    from hpc_core.tasks import get_task
    from hpc_core.tasks.base import Task

    if args.batch_size < 1:
        print(f"--batch-size {args.batch_size}: give a positive number", file=sys.stderr)
        return 2
    try:
        path = resolve_checkpoint(Path(args.checkpoint))
        model, own = load_model(path)
        cfg = (load_config(args.config, args.overrides) if args.config is not None
               else config_from_dict(apply_overrides(own.to_dict(), args.overrides),
                                     source=f"{path}/trainer_state.json"))
    except (CheckpointError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 2
    if cfg.task != own.task:
        print(f"--config {args.config}: task={cfg.task}, but {path} holds a {own.task} model: "
              f"give a {own.task} config", file=sys.stderr)
        return 2
    task: Task = get_task(own.task)
    _, val, _ = task.build_datasets(cfg.data)
    loader = make_loader(val, args.batch_size, cfg.data, collate_fn=task.collate)
    metrics = task.evaluate(model, loader)
    print(json.dumps({
        "checkpoint": str(path), "task": own.task, "samples": len(val),  # type: ignore[arg-type]
        "gate_metric": f"eval/{task.gate_metric}",
        **{f"eval/{k}": (None if math.isnan(v) else v) for k, v in metrics.items()},
    }))
    return 0
