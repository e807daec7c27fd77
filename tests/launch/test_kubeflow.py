"""scripts/k8s/pytorchjob.yaml against the Kubeflow Training Operator's PyTorchJob schema.

No cluster here: the CRD's openAPIV3Schema is vendored (tests/launch/data/README.md names the
release), validated with unknown fields rejected as `kubectl apply` does (strict field
validation), plus the checks of the operator's admission webhook.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpc_core.config import load_config
from hpc_core.train import add_train_args

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "scripts/k8s/pytorchjob.yaml"
SCHEMA = Path(__file__).parent / "data/pytorchjob_v1_schema.json"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _strict(node: Any) -> Any:
    """Unknown fields are errors, except where the schema keeps them (preserve-unknown)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def webhook_errors(job: dict[str, Any]) -> list[str]:
    """The PyTorchJob admission webhook's checks (training-operator v1.9.0)."""
    errors = []
    name = job.get("metadata", {}).get("name", "")
    if len(name) > 63 or not DNS1035.match(name):
        errors.append(f"metadata.name {name!r}: not a DNS-1035 label")
    spec = job["spec"]
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if spec.get("elasticPolicy") is not None and "Worker" not in replicas:
        errors.append("spec.pytorchReplicaSpecs[Worker]: must be configured with elasticPolicy")
    if spec.get("elasticPolicy", {}).get("nProcPerNode") is not None and "nprocPerNode" in spec:
        errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    for role, rs in replicas.items():
        if role not in ("Master", "Worker"):
            errors.append(f"spec.pytorchReplicaSpecs[{role}]: not Master or Worker")
        containers = rs.get("template", {}).get("spec", {}).get("containers", [])
        if not any(c.get("name") == "pytorch" for c in containers):
            errors.append(f"spec.pytorchReplicaSpecs[{role}]: no container named pytorch")
        errors += [
            f"{role} container {c.get('name')}: no image" for c in containers if not c.get("image")
        ]
        n = rs.get("replicas")
        if role == "Master" and n != 1:
            errors.append("spec.pytorchReplicaSpecs[Master].replicas: must be 1")
        elif n is not None and n < 1:
            errors.append(f"spec.pytorchReplicaSpecs[{role}].replicas: must be at least 1")
    return errors


def _validator() -> Any:
    schema = _strict(json.loads(SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


def _schema_errors(job: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in _validator().iter_errors(job)
    ]


@pytest.fixture
def job() -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    return doc


def test_manifest_matches_the_pytorchjob_schema(job: dict[str, Any]) -> None:
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert _schema_errors(job) == []
    assert webhook_errors(job) == []


def test_manifest_runs_a_valid_training_command(job: dict[str, Any]) -> None:
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert args[:2] == ["-m", "hpc_core.train"]
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    parsed = parser.parse_args(args[2:])
    assert parsed.resume == "auto"  # a rescheduled pod continues from the shared volume
    cfg = load_config(REPO / parsed.config, parsed.overrides)
    mount = container["volumeMounts"][0]["mountPath"]
    assert str(cfg.run.output_dir).startswith(mount)
    # Checkpoints must outlive the pod: the mount is a PersistentVolumeClaim.
    volumes = {
        v["name"]: v
        for v in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]
    }
    assert "persistentVolumeClaim" in volumes[container["volumeMounts"][0]["name"]]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda j: j["spec"].update(nprocPerNode=8),
            "spec.nprocPerNode: 8 is not of type 'string'",
        ),
        (lambda j: j["spec"].update(elasticPolcy={}), "'elasticPolcy' was unexpected"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="2"),
            "replicas: '2' is not of type 'integer'",
        ),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
                0
            ].update(args="-m hpc_core.train"),
            "is not of type 'array'",
        ),
    ],
)
def test_schema_rejects_broken_manifests(job: dict[str, Any], mutate: Any, expected: str) -> None:
    bad = copy.deepcopy(job)
    mutate(bad)
    errors = _schema_errors(bad)
    assert any(expected in e for e in errors), errors


def test_webhook_checks_reject_what_the_operator_rejects(job: dict[str, Any]) -> None:
    bad = copy.deepcopy(job)
    worker = bad["spec"]["pytorchReplicaSpecs"].pop("Worker")
    worker["template"]["spec"]["containers"][0]["name"] = "trainer"
    bad["spec"]["pytorchReplicaSpecs"]["Master"] = {**worker, "replicas": 2}
    bad["metadata"]["name"] = "Edgetrain_HPC"
    errors = webhook_errors(bad)
    assert len(errors) == 4, errors
