"""Staged rollouts: what to run where (``plan``), the durable state (``store``), one rollout
in memory (``run``) and what is due when (``schedule``), the controller's loop
(``controller``) with its messages (``messages``) and its decisions, each in a module named
for it (``abort``: when a rollout aborts itself; ``verdict``: when a wave is finished and how a
rollout ends; ``retry``: whether an ended execution runs again; ``controls``: the send
rate, wave approvals and where a joining device goes, acted on in ``operated``), the loop
every controller runs (``loop``), the controller replicas'
leases and inbox (``replicas``), and how a rollout is shown (``progress``, ``report``).

Of the fleet it may import the shared modules below it (``fleet.inventory``,
``fleet.commands``, ``fleet.mqtt``, ``fleet.db``), never ``fleet.learn`` (which drives
rollouts through it), ``fleet.cli``, or its siblings ``fleet.sim`` and ``fleet.broker``. The
decision modules send nothing and run no tool (``pyproject.toml``, ``[tool.importlinter]``).
"""
