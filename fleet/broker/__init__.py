"""The broker tier (``fleetctl broker-config``): mosquitto's listeners, accounts, passwords
and ACLs for an inventory of devices (``config``), and a bridged tier of regional brokers
under a core broker (``bridge``). Files only: it connects to no broker.

It imports nothing of the fleet: ``contract`` (the topics) and ``registry.atomic`` only.
"""
