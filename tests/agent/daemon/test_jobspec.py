"""The daemon validates job commands with the job's own models (agent.jobs.spec): the args a
command may carry (an allow-list per job type), resolved against the device's config."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.daemon.config import AgentConfig
from agent.daemon.jobspec import resolve_command_args
from agent.jobs.resolve import DeviceSettings
from agent.jobs.spec import COMMAND_ARGS, SPECS
from contract import JOB_TYPES, CommandRejected, error_from_validation


def _settings(tmp_path: Path, **cfg: object) -> DeviceSettings:
    (tmp_path / "data" / "d.npz").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / "d.npz").write_bytes(b"x")
    return AgentConfig.model_validate({"device_id": "edge-7", "state_dir": str(tmp_path),
                                       **cfg}).job_settings()


def test_every_contract_job_type_has_the_jobs_spec(tmp_path: Path) -> None:
    assert set(SPECS) == set(JOB_TYPES) == set(COMMAND_ARGS)
    dev = _settings(tmp_path, registry={"url": "/r"})
    ft = resolve_command_args("finetune", {"model": "digits", "data": "d.npz",
                                           "finetune": {"steps": 3}}, dev)
    # The stored spec is the resolved model's full dump: the worker re-validates it unchanged.
    assert SPECS["finetune"].model_validate(ft).model_dump(mode="json") == ft
    assert ft["finetune"]["steps"] == 3 and ft["steps"]["export"] is True
    assert ft["data"] == str(tmp_path / "data" / "d.npz")
    dep = resolve_command_args("deploy", {"model": "digits", "version": "2"}, dev)
    assert dep["version"] == "2" and dep["health"]["max_accuracy_drop_pts"] == 0.0
    assert dep["registry"] == "/r"
    rb = resolve_command_args("rollback", {"name": "digits", "reason": "drill"}, dev)
    assert rb["reason"] == "drill"


@pytest.mark.parametrize(("type_", "args", "field"), [
    ("deploy", {"model": "digits"}, "args.version"),
    ("finetune", {"model": "digits", "data": "d.npz", "finetune": {"stepz": 3}},
     "args.finetune.stepz"),
    ("finetune", {"model": "digits", "data": "d.npz", "finetune": {"micro_batch": 64,
                                                                   "effective_batch": 16}},
     "micro_batch"),
    ("rollback", {"name": "digits", "bogus": 1}, "args.bogus"),
])
def test_bad_job_args_name_the_field(tmp_path: Path, type_: str, args: dict, field: str) -> None:
    dev = _settings(tmp_path, registry={"url": "/r"})
    with pytest.raises((ValidationError, CommandRejected)) as e:
        resolve_command_args(type_, args, dev)
    message = (error_from_validation(e.value).message if isinstance(e.value, ValidationError)
               else e.value.message)
    assert field in message, message


@pytest.mark.parametrize(("type_", "args", "field"), [
    # The device's trust roots and targets: never a command's to choose.
    ("finetune", {"registry": "http://evil:8080"}, "args.registry"),
    ("finetune", {"trusted_keys": "/tmp/keys"}, "args.trusted_keys"),
    ("finetune", {"signing_key": "/tmp/k.pem"}, "args.signing_key"),
    ("finetune", {"upload": {"registry": "http://evil:8080"}}, "args.upload.registry"),
    ("deploy", {"registry": "http://evil:8080"}, "args.registry"),
    ("deploy", {"trusted_keys": "/tmp/keys"}, "args.trusted_keys"),
    ("rollback", {"trusted_keys": "/tmp/keys"}, "args.trusted_keys"),
    # Paths where a name belongs.
    ("finetune", {"data": "/etc/passwd"}, "args.data"),
    ("finetune", {"data": "../state/jobs.db"}, "args.data"),
    ("finetune", {"finetune": {"profile": "/tmp/evil"}}, "args.finetune.profile"),
    ("finetune", {"finetune": {"profile": "../../tmp/evil"}}, "args.finetune.profile"),
    ("finetune", {"export": {"tensorrt": {"timing_cache": "/var/lib/edge-agent/jobs.db"}}},
     "args.export.tensorrt.timing_cache"),
    ("deploy", {"data": "/data/cam0"}, "args.data"),
    ("finetune", {"model": "../x"}, "args.model"),
    ("deploy", {"version": "../../x"}, "args.version"),
])
def test_trust_roots_and_paths_are_refused_with_the_field(
    tmp_path: Path, type_: str, args: dict, field: str,
) -> None:
    base = {"finetune": {"model": "digits", "data": "d.npz"},
            "deploy": {"model": "digits", "version": "2"}, "rollback": {"name": "digits"}}
    dev = _settings(tmp_path, registry={"url": "/r"})
    with pytest.raises((ValidationError, CommandRejected)) as e:
        resolve_command_args(type_, {**base[type_], **args}, dev)
    message = (error_from_validation(e.value).message if isinstance(e.value, ValidationError)
               else e.value.message)
    assert field in message, message


def test_the_device_config_is_the_only_source_of_trust_and_paths(tmp_path: Path) -> None:
    key = tmp_path / "edge-7.key.pem"
    dev = _settings(tmp_path, profile="sim", sensors="sim", data_root=str(tmp_path / "data"),
                    registry={"url": "http://reg:8080", "upload_url": "http://up:8080",
                              "signing_key": str(key)})
    ft = resolve_command_args("finetune", {"model": "digits", "data": "d.npz",
                                           "finetune": {"epochs": 2, "sensors": "none"},
                                           "export": {"tensorrt": {"timing_cache": "orin"}},
                                           "steps": {"upload": True}}, dev)
    assert ft["registry"] == "http://reg:8080" and ft["upload"]["registry"] == "http://up:8080"
    assert ft["signing_key"] == str(key)  # signer = the device id
    assert ft["trusted_keys"] == str(tmp_path / "trusted_keys")
    assert ft["export"]["tensorrt"]["timing_cache"] == str(tmp_path / "cache/tensorrt/orin")
    # The board's profile unless the command names another; the command's own knobs win.
    assert (ft["finetune"]["profile"], ft["finetune"]["sensors"]) == ("sim", "none")
    assert ft["finetune"]["epochs"] == 2
    rb = resolve_command_args("rollback", {"name": "digits"}, dev)
    assert "registry" not in rb and rb["trusted_keys"] == str(tmp_path / "trusted_keys")

    unset = _settings(tmp_path)
    assert resolve_command_args("finetune", {"model": "digits", "data": "d.npz"},
                                unset)["signing_key"] == str(tmp_path / "device.key.pem")
    with pytest.raises(CommandRejected, match=r"args\.steps\.upload: this device has no "
                       "registry"):
        resolve_command_args("finetune", {"model": "digits", "data": "d.npz",
                                          "steps": {"upload": True}}, unset)
    with pytest.raises(CommandRejected, match=r"args\.version: this device has no registry"):
        resolve_command_args("deploy", {"model": "digits", "version": "2"}, unset)
    with pytest.raises(CommandRejected, match=r"args\.data: no data set 'cam9'"):
        resolve_command_args("finetune", {"model": "digits", "data": "cam9"}, unset)


def test_a_data_name_may_not_lead_out_of_the_data_root(tmp_path: Path) -> None:
    dev = _settings(tmp_path)
    (tmp_path / "data" / "escape").symlink_to(tmp_path)  # planted inside data_root
    with pytest.raises(CommandRejected, match="leads out of data_root"):
        resolve_command_args("finetune", {"model": "digits", "data": "escape"}, dev)
