"""Fleet learning, upstream: combine device fine-tunes of a release into the next model.

``hpc-train aggregate`` (``command``) runs one round (``round``): pick and verify the device
uploads (``select``), hash and measure them (``combine.measure_updates``, reading through
``blobs`` and ``deltas``), combine their deltas block by block (``strategies``), optionally
add Gaussian noise (``privacy``), and write a checkpoint plus ``aggregate.json``
(``output``, ``report``). numpy only: torch is never imported here.
"""
