"""Simulated devices that speak the agent's MQTT contract, many per process, for tests and
benchmarks (``python -m fleet.sim``, the command line in ``__main__``): what they simulate
(``config``), one device (``device``), and the one thread that drives them all (``fleet``).
A device sees its fleet only through the ``device.SimHost`` protocol: ``fleet`` imports
``device``, never the other way round.

It may import ``fleet.mqtt`` of the fleet and nothing else; nothing in ``fleet`` imports it.
"""
