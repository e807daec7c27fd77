"""Fleet learning (``fleetctl learn``): rounds of fine-tune, aggregate, evaluate and publish
behind gates, one resumable state machine per learn (``driver``) inside the rollout
controller's loop (``loop``). The plan (``plan``), the rounds' durable record (``store``),
the upstream tools run as children tied to the controller (``upstream``, ``child``), what the
devices' results give a round (``updates``: the uploads a round combines and those it
refuses; ``evaluations``: the devices' scores of a candidate), the round's decisions, each in
a module named for it (``quorum``: aggregate now, wait, or skip the round; ``gates``: the
gates a candidate and a release pass and what a publish decided), and the status and report
(``report``).

Of the fleet it may import ``fleet.rollout`` (its rounds are rollouts) and the shared
modules below it (``fleet.inventory``, ``fleet.commands``, ``fleet.mqtt``, ``fleet.db``),
never ``fleet.cli``, ``fleet.sim`` or ``fleet.broker``. The decision modules send nothing and
run no tool; ``child`` imports nothing but the standard library (it is started by its path).
"""
