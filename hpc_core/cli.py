"""hpc-train: validate configs, train models, publish signed checkpoints, aggregate device
fine-tunes."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from hpc_core.aggregation.command import register_cli as register_aggregate_cli
from hpc_core.batch_find import add_batch_find_args, run_batch_find
from hpc_core.config import ConfigError, load_config, reference_markdown, summarize
from hpc_core.estimate import add_estimate_args, run_estimate
from hpc_core.evaluation.cli import add_evaluate_args, run_evaluate
from hpc_core.lr_find import add_lr_find_args, run_lr_find
from hpc_core.train import add_train_args, run
from hpc_core.tune.command import add_tune_args, run_tune
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections

EPILOG = """\
examples:
  hpc-train validate configs/digits.yaml
  hpc-train train --config configs/digits.yaml --set run.output_dir=runs/digits
  hpc-train train --config configs/digits.yaml --resume auto
  hpc-train train --config configs/detection.yaml --set run.output_dir=runs/det
  hpc-train evaluate runs/det --set data.synthetic.seed=1
  torchrun --nproc-per-node 2 -m hpc_core.train --config configs/hpc.yaml

exit codes: 0 ok, 1 training failed, 2 invalid config or arguments
"""


def validate(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(Path(args.config), args.overrides)
        from hpc_core.models import model_spec_errors

        errors = model_spec_errors(cfg.model.name, cfg.model.kwargs)
        if errors:
            raise ConfigError(str(args.config), errors)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"# {args.config}: valid (digest {cfg.digest()[:12]})")
    print(summarize(cfg), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpc-train",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    v = sub.add_parser(
        "validate",
        help="check a config; print every error with its field path",
        description="Check a config file. Valid: print the resolved config. "
        "Invalid: print each error with its field path and a hint, exit 2.",
    )
    v.add_argument("config", help="YAML config")
    v.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field before validating (repeatable)",
    )
    v.set_defaults(func=validate)
    d = sub.add_parser(
        "config-docs",
        help="print the config reference (Markdown)",
        description="Print every config key with its default and meaning.",
    )
    d.set_defaults(func=lambda args: print(reference_markdown()) or 0)
    t = sub.add_parser(
        "train",
        help="train a model (single process; use torchrun for DDP)",
        description="Train a model from a config, single process. For several "
        "processes or nodes run `torchrun ... -m hpc_core.train`.",
    )
    add_train_args(t)
    t.set_defaults(func=run)
    ev = sub.add_parser(
        "evaluate",
        help="a checkpoint's metrics on a validation split (top-1, or COCO mAP for a detector)",
        description="Rebuild a checkpoint's model and score it on its config's validation "
        "split (or another config's, --config / --set) with its task's metrics; print one "
        "JSON line.",
    )
    add_evaluate_args(ev)
    ev.set_defaults(func=run_evaluate)
    tu = sub.add_parser(
        "tune",
        help="hyperparameter search with Optuna (one worker per process, shared storage)",
        description="Run trials of a study until it holds --trials finished or running ones "
        "(failed trials are replaced); any number of workers may share the study through "
        "--storage.",
    )
    add_tune_args(tu)
    tu.set_defaults(func=run_tune)
    lf = sub.add_parser(
        "lr-find",
        help="learning-rate range test: suggestion + plot",
        description="Sweep the LR exponentially for a few steps; suggest the LR at the "
        "steepest descent of the smoothed loss; plot loss against LR.",
    )
    add_lr_find_args(lf)
    lf.set_defaults(func=run_lr_find)
    bf = sub.add_parser(
        "batch-find",
        help="largest batch a training run fits in memory",
        description="Double the batch until a probe (steps, an evaluation and a checkpoint "
        "save, in a fresh process) runs out of memory or passes --limit-mb less the headroom, "
        "then bisect; never above the training set's size.",
    )
    add_batch_find_args(bf)
    bf.set_defaults(func=run_batch_find)
    es = sub.add_parser(
        "estimate",
        help="time and cost of a run on N nodes of a GPU model, from a short probe",
        description="Probe a few training steps, an evaluation and a save on this machine; "
        "print epoch time, total time and cost with the assumption behind each number.",
    )
    add_estimate_args(es)
    es.set_defaults(func=run_estimate)
    # Publishing lives in its own module; it is optional until that module exists.
    try:
        publish_cli = importlib.import_module("hpc_core.publish_cli")
    except ModuleNotFoundError as e:
        if e.name != "hpc_core.publish_cli":
            raise
    else:
        publish_cli.register_cli(sub)
    register_aggregate_cli(sub)
    from hpc_core.vision.weights_cli import register_cli as register_weights_cli

    register_weights_cli(sub)
    return p


@private_umask()
def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
