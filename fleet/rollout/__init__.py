"""Staged rollouts: what to run where (``plan``), the durable state (``store``), one rollout
in memory (``run``) and what is due when (``schedule``), the controller's loop
(``controller``) and its messages (``messages``), the controller replicas' leases and inbox
(``replicas``), and how a rollout is shown (``progress``, ``report``).

It may import ``fleet.db``, ``fleet.mqtt`` and ``fleet.inventory`` of the fleet, never
``fleet.learn`` (which drives rollouts through it), ``fleet.cli`` or ``fleet.sim``.
"""
