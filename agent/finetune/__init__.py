"""On-device fine-tuning: the job (``job``, torch-free), the device's active model loaded and
re-verified (``active``), the model preparation (``model``), the micro-batch plan from the
memory budget (``memory_plan``) and the recipe that runs it paced by the governor
(``recipe``). ``python -m agent.finetune JOB_JSON`` runs one job."""
