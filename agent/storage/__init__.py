"""Device-side model storage; torch-free at import (the daemon reports the active model
without loading torch).

Layout under the state directory::

    lock                               flock: one pull / install / rollback / gc at a time
    job.lock                           flock: one job at a time, held for the whole job
    chunks/sha256/ab/<hash>            verified chunks, content-addressed, shared by versions
    chunks/partial/<hash>.part         downloads in progress (resumed with HTTP Range)
    models/<name>/slots/{a,b}/         complete versions (see ``slots``); COMMITTED in one
                                       that passed its gates, base.manifest.* in a device
                                       version (its upstream release, ``registry.lineage``)
    models/<name>/current -> slots/a   the active slot
    models/<name>/installed.json       what was committed: the anti-rollback record

Modules: ``lock`` (state lock, job lock), ``nofollow`` (no symlink is ever followed below
the state root), ``chunk_store``, ``assemble`` (chunks -> slot), ``verify`` (slot re-verification),
``anti_rollback`` (the record, and ``refuse_downgrade``: the rule no older signed version
passes), ``slot_folder`` (one slot: read, build, the committed marker), ``slots`` (the two
slots and ``current``: stage / commit / discard / install / rollback), ``gc``, ``spec_check``
(the model spec check: torch-free for a registered model, a torch child for a custom factory),
``update`` (pull into the slots, stage a local fine-tune). Building the active model needs
torch: ``agent.finetune.active``.
"""
