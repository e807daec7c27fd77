"""Fleet learning, upstream: combine device fine-tunes of a release into the next model.

``hpc-train aggregate`` (``command``) runs one round (``round``): pick and verify the device
uploads (``select``), hash and measure them (``combine.measure_updates``, reading through
``blobs`` and ``deltas``), flag near-identical updates (``duplicates``), combine their deltas
block by block (``strategies``; under DP with the fixed-denominator weights and Gaussian
noise of ``privacy``), and write a checkpoint plus ``aggregate.json`` (``output``,
``report``). ``in_memory`` applies the same rules to updates held as one array, for
simulated fleets. numpy only: torch is never imported here.
"""
