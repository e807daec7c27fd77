"""Scoring checkpoints outside a training run, through the model's task (top-1 of a
classifier, mAP of a detector):

- ``cli``: ``hpc-train evaluate``, a checkpoint's metrics on a validation split;
- ``upstream``: a base checkpoint and a candidate on the upstream held-out split, the torch
  half of ``hpc-train publish --max-upstream-drop`` (the gate itself is torch-free:
  ``hpc_core.aggregation.gates``).

The trainer's own evaluation during a run is the task's (``hpc_core.tasks``); the devices'
evaluations of a fleet round are ``agent.jobs.steps.evaluate``.
"""
