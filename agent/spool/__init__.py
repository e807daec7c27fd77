"""The data spool: samples an application records on the device (its inputs, a label when it
has one, the model's logits), kept within a disk quota for the next fine-tune.

- :mod:`agent.spool.config`: :class:`~agent.spool.config.SpoolConfig` and where a model's
  spool lives (``DATA_ROOT/spool/MODEL``); numpy-free, so the daemon's command checks can
  import it.
- :mod:`agent.spool.segment`: one record on disk (header + float32 samples).
- :mod:`agent.spool.index`: the samples on disk as arrays, rebuilt from the files.
- :mod:`agent.spool.policy`: how sure the model was of a sample, and which sample goes first.
- :mod:`agent.spool.store`: :class:`~agent.spool.store.Spool` (``record``, ``stats``,
  ``snapshot``), the one entry point an application uses.
- :mod:`agent.spool.snapshot`: the .npz a fine-tune trains on.
- :mod:`agent.spool.lineage`: what a fine-tune learned from, fixed once per job and signed
  into the version's manifest.

A fine-tune job given ``data: spool`` trains on a snapshot of the model's spool
(``agent.jobs.steps.finetune``).
"""
