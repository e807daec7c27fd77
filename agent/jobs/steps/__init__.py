"""The device job's steps, one module each holding both halves: the worker's function
``run(ctx: JobContext) -> dict`` (torch-free, in the job process) and, for the heavy steps,
the child's (``python -m agent.jobs.steps.STEP NAME JOB_DIR``, the module's ``CHILDREN``), so
a reader sees a step whole. Which step follows which, and which function runs each state, is
the state machine's (``agent.jobs.machine``: ``TRANSITIONS`` and ``WORKER_STEPS``), not theirs.

To add a step: a module here with ``run`` (and, if it needs torch, ``child(c: StepContext) ->
dict`` in its ``CHILDREN`` with the two-line ``__main__`` block the others end with), one entry
in ``machine.WORKER_STEPS``, and its edges in ``machine.TRANSITIONS`` for the job types that
run it. This package imports none of them: ``python -m`` of one step loads that step alone.
"""
