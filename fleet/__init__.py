"""The cloud side of the fleet (``fleetctl``): it speaks the agents' MQTT contract
(``contract``) and the registry, nothing else of this repository.

Its layers, top down; each imports only from the layers below it, never from one above or
from a sibling beside it (``pyproject.toml``, ``[tool.importlinter]``, checks it):

1. ``fleet.cli``: ``fleetctl``, the command line over everything below.
2. ``fleet.dashboard``: ``fleetctl dashboard``, the operator's live web page (it reads
   rollouts and learns; its writes are the command line's requests, ``fleet.rollout.operator``).
3. ``fleet.learn``: rounds of fleet learning, driven inside the rollout controller's loop,
   and the decisions a round takes (``updates``, ``quorum``, ``gates``).
4. ``fleet.rollout``: staged rollouts: the plan, the store, the controller and the decisions
   it takes (``abort``, ``verdict``, ``retry``), replicas, reports. Beside it ``fleet.sim``:
   simulated devices (``python -m fleet.sim``), for tests and benchmarks only; and
   ``fleet.broker``: mosquitto's accounts, ACLs and bridged tiers (``fleetctl
   broker-config``).
5. ``fleet.inventory`` (the devices, from their retained status; tables) and
   ``fleet.commands`` (one command and its replies: ``fleetctl send``).
6. ``fleet.mqtt`` (the broker connection, where a message's sender is decided) and
   ``fleet.db`` (SQLite or PostgreSQL).
"""
