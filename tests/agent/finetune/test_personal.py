"""agent.finetune.personal: a device's own head and normalization, copied into the fleet's
model tensor for tensor, nothing else touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.finetune.personal import personal_keys, personalize


def net(seed: int, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, width, 3), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3), nn.GroupNorm(2, width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def test_the_parts_name_the_head_and_every_norm() -> None:
    m = net(0)
    assert personal_keys(m, ["head"]) == {"8.weight", "8.bias"}
    assert personal_keys(m, ["norm"]) == {
        "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
        "4.weight", "4.bias"}
    assert personal_keys(m, []) == set()


def test_personalize_copies_exactly_the_own_parts() -> None:
    fleet, own = net(0), net(1)
    own[1].running_mean += 3.0  # a camera's statistics, learned on the device
    before = {k: v.clone() for k, v in fleet.state_dict().items()}
    n = personalize(fleet, own, ["head", "norm"])
    keys = personal_keys(fleet, ["head", "norm"])
    assert n == len(keys) == 9
    after, mine = fleet.state_dict(), own.state_dict()
    for k, v in after.items():
        expected = mine[k] if k in keys else before[k]
        assert torch.equal(v, expected), k
    assert not torch.equal(after["0.weight"], mine["0.weight"])  # the body stays the fleet's


def test_another_architecture_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"no tensor 8\.weight of shape \(10, 8\)"):
        personalize(net(0), net(1, width=16), ["head"])


def test_an_evaluate_command_names_parts_only_from_the_list() -> None:
    # What another principal may send (an evaluate command's args): two known part names at
    # most, never a path or a module; the rest is refused naming the field.
    from pydantic import ValidationError

    from agent.jobs.evaluate_spec import EvaluateArgs

    ok = EvaluateArgs.model_validate({"model": "digits", "version": "3", "data": "cam0",
                                      "evaluate": {"personal": ["head", "norm"]}})
    assert ok.evaluate.personal == ["head", "norm"]
    for bad in (["classifier"], ["/etc/passwd"], ["head", "norm", "head"]):
        with pytest.raises(ValidationError, match="personal"):
            EvaluateArgs.model_validate({"model": "digits", "version": "3", "data": "cam0",
                                         "evaluate": {"personal": bad}})
