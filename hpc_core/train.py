"""Entry point for one training run, single process or under torchrun.

python -m hpc_core.train --config configs/digits.yaml
torchrun --nproc-per-node 2 -m hpc_core.train --config configs/hpc.yaml --set training.max_steps=100
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from hpc_core.config import ConfigError, load_config
from hpc_core.logs import setup_logging
from registry.atomic import private_umask
from registry.lifetime import skip_startup_and_exit_collections

log = logging.getLogger("hpc_core.train")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see configs/ and the README)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set training.max_steps=200 (repeatable)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="auto: continue from the run's newest checkpoint if any; PATH: that "
        "checkpoint or run directory",
    )
    p.add_argument(
        "--log-format",
        choices=["auto", "text", "json"],
        default="auto",
        help="auto: text at a terminal, JSON lines otherwise (journald, CI)",
    )


def run(args: argparse.Namespace) -> int:
    import os

    setup_logging(args.log_format, rank=int(os.environ.get("RANK", "0")))
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from hpc_core.distributed import shutdown
    from hpc_core.trainer import Trainer, TrainingDiverged

    trainer = Trainer(cfg)
    try:
        result = trainer.train(resume=args.resume)
    except TrainingDiverged as e:
        log.error("%s", e)
        return 1
    finally:
        shutdown(trainer.dist)
    if trainer.dist.is_main:
        print(
            json.dumps(
                {
                    "step": result.final_step,
                    "stopped": result.stopped_reason,
                    "checkpoint": str(result.checkpoint_dir),
                    **result.metrics,
                }
            )
        )
    return 0


@private_umask()
def main(argv: list[str] | None = None) -> int:
    skip_startup_and_exit_collections()
    p = argparse.ArgumentParser(
        prog="python -m hpc_core.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_args(p)
    from hpc_core.distributed import end_rank  # torch: imported once the arguments parse

    return end_rank(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
