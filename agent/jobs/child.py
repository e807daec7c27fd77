"""``python -m agent.jobs.child STEP JOB_DIR``: one torch step of a device job.

The worker stays torch-free (~35 MB) so that the memory budget can go to the one torch process
alive at a time: the planner's probes, then the fine-tune, export or health check. The child
reads its typed context (JOB_DIR/context.json, ``agent.jobs.protocol.StepContext``), runs the
step's child half (``agent.jobs.steps.CHILD_STEPS``) and writes JOB_DIR/STEP.json atomically
when it is done; the worker records that in the store.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from agent.jobs.protocol import die_with_parent, read_context
from agent.jobs.steps import CHILD_STEPS
from hpc_core.atomic import write_json_atomic


def main(argv: list[str]) -> int:
    step, job_dir = argv[0], Path(argv[1])
    die_with_parent()
    out = CHILD_STEPS[step](read_context(job_dir))
    write_json_atomic(job_dir / f"{step}.json", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
