"""What a device job must have before anything starts: checks that fail with exit 2 and the
option named, before any probe, download, job folder or store row. Reads only."""

from __future__ import annotations

from pathlib import Path

from agent.finetune.job import spool_too_small
from agent.finetune.memory_fits import submitted_refusal
from agent.jobs.spec import DeviceJob
from agent.jobs.task_checks import installed_task, task_refusal
from agent.spool.config import is_spool


def check_signing_key(job: DeviceJob, state_dir: Path) -> None:
    """The stage step signs the fine-tuned model with the device's key, and the device then
    verifies it like any version: the key must load and its public half must be trusted here
    with a scope covering this model's device versions. Checked first: without it the job
    would fail minutes later, after the fine-tune."""
    from agent.storage.trust import default_trusted_keys, load_trusted
    from registry.errors import RegistryError
    from registry.signing import load_signing_key

    path = Path(job.signing_key or Path(state_dir) / "device.key.pem")
    how = ("make one with `hpc-train keygen --out STATE_DIR --name DEVICE --scope "
           f"'{job.model}@*+DEVICE.*'`, then copy DEVICE.pub.pem and DEVICE.scope into "
           "the trusted-keys folder (and pass --signing-key STATE_DIR/DEVICE.key.pem)")
    if not path.is_file():
        raise ValueError(f"--signing-key {path}: no such file: the device signs what it "
                         f"fine-tunes with its own key; {how}")
    try:
        key = load_signing_key(path)
    except (RegistryError, OSError, ValueError) as e:
        raise ValueError(f"--signing-key {path}: {e}") from None
    trusted_dir = Path(job.trusted_keys or default_trusted_keys(Path(state_dir)))
    try:
        trusted = load_trusted(trusted_dir)
    except (RegistryError, OSError, ValueError) as e:
        raise ValueError(f"--trusted-keys {trusted_dir}: {e}") from None
    mine = trusted.get(key.key_id)
    if mine is None:
        raise ValueError(f"--signing-key {path}: its public half ({key.name}, "
                         f"{key.key_id}) is not in {trusted_dir}, so the device would refuse "
                         f"what it signs: copy {key.name}.pub.pem (and {key.name}.scope) there")
    probe = f"{job.version or 'v'}+{key.name}.check"
    if not mine.may_sign(job.model, probe):
        raise ValueError(f"--signing-key {path}: its scope in {trusted_dir} "
                         f"({', '.join(mine.scope)}) does not cover {job.model}@*+{key.name}.*")


def check_inputs(job: DeviceJob, state_dir: Path | None = None) -> None:
    """Checks on the file system that must fail before any probe, download or job folder:
    each raises ValueError naming the option. With ``state_dir``: the upstream model must be
    readable there (its slot marker and signed manifest), or fetchable (--registry). Reads
    only; creates nothing."""
    data = job.data
    if state_dir is not None:
        _check_upstream(job, Path(state_dir))
    _check_forced_micro_batch(job, state_dir)
    if not data.exists():
        raise ValueError(f"--data {data}: no such file or folder")
    if is_spool(data):  # recorded samples: the fine-tune step snapshots them, checks again
        why = spool_too_small(data, job.finetune.effective_batch, job.finetune.val_fraction)
        if why is not None:
            raise ValueError(f"--data: {why}")
        return
    task = installed_task(Path(state_dir), job.model, job.version) if state_dir else None
    refused = task_refusal(task, data, job.steps.export)
    if refused is not None:  # the installed model's task: a detector cannot export, ...
        field, why = refused
        raise ValueError(f"--{'no-export' if field == 'steps.export' else 'data'}: {why}")
    if data.is_dir():
        if not any(p.is_dir() and any(p.iterdir()) for p in data.iterdir()):
            raise ValueError(f"--data {data}: empty (no class sub-folder with images)")
    elif data.suffix != ".npz":
        raise ValueError(f"--data {data}: expected a folder of class sub-folders or an .npz")
    elif data.stat().st_size == 0:
        raise ValueError(f"--data {data}: empty file")
    else:
        try:
            import zipfile

            with zipfile.ZipFile(data) as z:
                names = set(z.namelist())
        except (OSError, zipfile.BadZipFile) as e:
            raise ValueError(f"--data {data}: not a readable .npz ({e})") from None
        if not {"x.npy", "y.npy"} <= names:
            raise ValueError(f"--data {data}: the .npz needs arrays x and y")


def _check_forced_micro_batch(job: DeviceJob, state_dir: Path | None) -> None:
    """A micro-batch forced beside an explicit budget, checked against the fit this device's
    probes recorded for the same job (agent.finetune.memory_fits); without one the fine-tune
    step probes and refuses it before anything trains."""
    if state_dir is None or not job.data.exists():
        return
    why = submitted_refusal(Path(state_dir), job.model, job.version, job.data,
                            job.finetune.model_dump())
    if why is not None:
        raise ValueError(f"--micro-batch: {why}")


def _check_upstream(job: DeviceJob, state_dir: Path) -> None:
    from agent.storage.slots import ModelSlots
    from registry.errors import RegistryError

    slots = ModelSlots(state_dir, job.model)
    try:
        active = slots.active()
        base = slots.installed(job.version) if active is not None else None
    except RegistryError as e:
        if "not installed" in str(e) and job.registry:
            return  # another version: pull fetches it
        raise ValueError(f"--model {job.model}: the installed checkpoint is unreadable ({e})"
                         if "not installed" not in str(e) else
                         f"--version {job.version}: {e}; give --registry to fetch it") from None
    if base is None and not (job.version and job.registry):
        raise ValueError(f"--model {job.model}: not installed in {state_dir}; give --version "
                         "and --registry to fetch it")
    if base is not None and not (base.path / "model.safetensors").is_file():
        raise ValueError(f"--model {job.model}: the installed checkpoint {base.path} has no "
                         "model.safetensors")
