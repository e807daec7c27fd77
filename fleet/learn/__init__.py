"""Fleet learning (``fleetctl learn``): rounds of fine-tune, aggregate, evaluate and publish
behind gates, one resumable state machine per learn (``driver``) inside the rollout
controller's loop (``loop``). The plan (``plan``), the rounds' durable record (``store``),
the upstream tools run as children tied to the controller (``upstream``, ``child``), what the
devices' results give a round (``results``), and the status and report (``report``).

It may import ``fleet.rollout`` (its rounds are rollouts) and the shared ``fleet.db`` and
``fleet.inventory``, never ``fleet.cli`` or ``fleet.sim``. ``child`` imports nothing but the
standard library: it is started by its path.
"""
