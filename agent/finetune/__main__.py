"""``python -m agent.finetune JOB_JSON``: one job in a process of its own, so its peak RSS is
its own; prints the report plus that peak (``rss_mb``) as one JSON line."""

from __future__ import annotations

import json
import sys

from agent.finetune.job import FinetuneJob
from agent.finetune.recipe import run_finetune
from hpc_core.metrics import peak_rss_mb
from registry.lifetime import skip_startup_and_exit_collections


def main(job_json: str) -> None:
    skip_startup_and_exit_collections()
    result = run_finetune(FinetuneJob.model_validate_json(job_json))
    print(json.dumps({**result.report, "rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main(sys.argv[1])
