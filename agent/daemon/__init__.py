"""``edge-agent``, the on-device daemon: config, main loop, job queue, control socket.

Torch-free: jobs run in ``python -m agent.jobs.worker`` subprocesses.
"""
