"""Hyperparameter search: ``hpc-train tune``, Optuna studies shared by any number of workers.

It owns everything a study needs and nothing else of training (a trial is an ordinary
``hpc_core.trainer`` run): ``command`` (the flags and ``run_tune``, each process one worker),
``search_space`` (the space file, validated like a config, sampled through Optuna), ``worker``
(joining the study: sampler, pruner, the trial loop), ``trial`` (one trial: its config, pruning
hook, heartbeat and how it ends in the study), ``storage`` (the shared SQLite or PostgreSQL
storage, safe to open from many workers at once) and ``report`` (``summary.md``,
``best_config.yaml``, ``history.png``). ``--backend ray`` runs the same study through Ray
Tune: ``ray_backend`` (the driver: searcher, scheduler, restore), ``ray_trial`` (one trial in a
Ray worker) and ``ray_results`` (the experiment as a study for ``report``); they import ray, an
optional extra, and only that backend imports them. Its parts log to the one logger
``hpc_core.tune``.
"""
