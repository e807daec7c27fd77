"""The device job: a persisted state machine (pull, fine-tune, export, stage, health, commit or
roll back, upload) and its store. ``store`` is torch-free; the steps import torch lazily."""
