"""The daemon validates job commands with the device job's own spec models (agent.jobs.spec)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.daemon.jobspec import validate_job
from agent.jobs.spec import SPECS
from agent.mqtt.contract import JOB_TYPES, error_from_validation


def test_every_contract_job_type_has_the_jobs_spec() -> None:
    assert set(SPECS) == set(JOB_TYPES)
    ft = validate_job("finetune", {"model": "digits", "data": "/d/device.npz",
                                   "finetune": {"steps": 3}})
    # The stored spec is the spec model's full dump: the worker re-validates it unchanged.
    assert SPECS["finetune"].model_validate(ft).model_dump(mode="json") == ft
    assert ft["finetune"]["steps"] == 3 and ft["steps"]["export"] is True
    dep = validate_job("deploy", {"model": "digits", "version": "2", "registry": "/r"})
    assert dep["version"] == "2" and dep["health"]["max_accuracy_drop_pts"] == 0.0
    assert validate_job("rollback", {"name": "digits", "reason": "drill"})["reason"] == "drill"


@pytest.mark.parametrize(("type_", "args", "field"), [
    ("deploy", {"model": "digits", "registry": "/r"}, "args.version"),
    ("finetune", {"model": "digits", "data": "/d", "finetune": {"stepz": 3}},
     "args.finetune.stepz"),
    ("finetune", {"model": "digits", "data": "/d", "finetune": {"micro_batch": 64,
                                                                "effective_batch": 16}},
     "micro_batch"),
    ("rollback", {"name": "digits", "bogus": 1}, "args.bogus"),
])
def test_bad_job_args_name_the_field(type_: str, args: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        validate_job(type_, args)
    err = error_from_validation(e.value)
    assert err.code == "BAD_ARGS" and field in err.message, err.message


def test_device_defaults_fill_what_the_command_leaves_out(tmp_path) -> None:
    from agent.daemon.config import AgentConfig

    key = str(tmp_path / "edge-7.key.pem")
    cfg = AgentConfig.model_validate({"device_id": "edge-7", "state_dir": str(tmp_path),
                                      "registry": {"url": "http://reg:8080", "signing_key": key}})
    ft = validate_job("finetune", {"model": "digits", "data": "d.npz",
                                   "steps": {"upload": True}}, cfg.job_defaults())
    assert ft["registry"] == "http://reg:8080"  # upload needs one: no longer refused
    assert ft["signing_key"] == str(tmp_path / "edge-7.key.pem")  # signer = the device id
    assert ft["trusted_keys"] == str(tmp_path / "trusted_keys")
    unset = AgentConfig.model_validate({"device_id": "edge-7", "state_dir": str(tmp_path)})
    assert validate_job("finetune", {"model": "digits", "data": "d.npz"},
                        unset.job_defaults())["signing_key"] is None  # the job's own default
    assert (ft["finetune"]["profile"], ft["finetune"]["sensors"]) == ("auto", "auto")
    sim = AgentConfig.model_validate({"device_id": "edge-7", "state_dir": str(tmp_path),
                                      "profile": "sim", "sensors": "sim"})
    ft = validate_job("finetune", {"model": "digits", "data": "d.npz",
                                   "finetune": {"epochs": 2, "sensors": "none"}},
                      sim.job_defaults())
    assert ft["finetune"] == {**ft["finetune"], "profile": "sim", "sensors": "none",
                              "epochs": 2}
    mine = validate_job("finetune", {"model": "digits", "data": "d.npz", "registry": "/r"},
                        cfg.job_defaults())
    assert mine["registry"] == "/r"  # what the command says wins
    rb = validate_job("rollback", {"name": "digits"}, cfg.job_defaults())
    assert "registry" not in rb and rb["trusted_keys"] == str(tmp_path / "trusted_keys")
    with pytest.raises(ValidationError, match=r"steps\.upload needs a registry"):
        validate_job("finetune", {"model": "digits", "data": "d.npz",
                                  "steps": {"upload": True}})
