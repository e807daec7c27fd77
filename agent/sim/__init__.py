"""Simulation for tests and benchmarks: the thermal plant of a board (``plant``), a paced job
in simulated time (``job``) and the baseline controllers the governor is compared with
(``baselines``). Nothing on a device imports this package except the ``sim`` sensor backend."""
