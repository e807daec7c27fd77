from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpc_core.cli import main
from hpc_core.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]

# (what is wrong, YAML text, the field path the error must name)
BAD_CONFIGS = [
    ("unknown top-level key", "trainig: {epochs: 1}\n", "trainig"),
    (
        "unknown nested key",
        "optimizer: {learning_rate: 0.1}\ntraining: {epochs: 1}\n",
        "optimizer.learning_rate",
    ),
    ("wrong type", "training: {epochs: 1, global_batch_size: big}\n", "training.global_batch_size"),
    ("out of range", "optimizer: {lr: -1}\ntraining: {epochs: 1}\n", "optimizer.lr"),
    ("bad choice", "training: {epochs: 1, precision: fp8}\n", "training.precision"),
    ("missing required path", "data: {source: npz}\ntraining: {epochs: 1}\n", "data"),
    (
        "incompatible options",
        "optimizer: {name: adamw, nesterov: true}\ntraining: {epochs: 1}\n",
        "optimizer",
    ),
    ("no run length", "training: {global_batch_size: 8}\n", "training"),
    (
        "micro larger than global",
        "training: {epochs: 1, global_batch_size: 8, micro_batch_size: 16}\n",
        "training",
    ),
    ("workers knob without workers", "data: {prefetch_factor: 2}\ntraining: {epochs: 1}\n", "data"),
    ("unknown model", "model: {name: small_cnnn}\ntraining: {epochs: 1}\n", "model.name"),
    (
        "kwarg the factory does not take",
        "model: {name: small_cnn, kwargs: {widht: 8}}\ntraining: {epochs: 1}\n",
        "model.kwargs.widht",
    ),
    ("empty file", "", "(top level)"),
    ("comment-only file", "# nothing yet\n\n", "(top level)"),
    (
        "duplicate key",
        "training: {epochs: 1}\noptimizer: {lr: 0.1, lr: 0.2}\n",
        "optimizer.lr: duplicate key",
    ),
    ("duplicate section", "training: {epochs: 1}\ntraining: {epochs: 2}\n", "training: duplicate"),
]


@pytest.mark.parametrize(("what", "text", "field"), BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_validate_names_the_field(what: str, text: str, field: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"  {field}" in err, f"{what}: error does not name {field!r}:\n{err}"


def test_unknown_key_suggests_the_close_match(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer: {lrr: 0.1}\ntraining: {epochs: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "did you mean 'lr'" in str(e.value)


def test_every_error_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer: {lr: -1, foo: 1}\ntraining: {epochs: 0, precision: fp8}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert len(e.value.errors) == 4


def test_not_yaml_and_not_a_mapping(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("training: [unclosed\n")
    assert main(["validate", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    path.write_text("- a\n- b\n")
    assert main(["validate", str(path)]) == 2
    assert "top level must be a mapping" in capsys.readouterr().err


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    cfg = load_config(
        REPO / "configs/digits.yaml",
        ["training.max_steps=7", "optimizer.betas=[0.8, 0.9]", "data.image_size=32"],
    )
    assert cfg.training.max_steps == 7
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.data.image_size == 32
    with pytest.raises(ConfigError, match=r"training\.max_stepz"):
        load_config(REPO / "configs/digits.yaml", ["training.max_stepz=7"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(REPO / "configs/digits.yaml", ["training.max_steps"])


@pytest.mark.parametrize("name", ["digits.yaml", "hpc.yaml", "embedded.yaml", "detection.yaml",
                                  "detection_cpu.yaml"])
def test_shipped_configs_validate(name: str, capsys) -> None:
    assert main(["validate", str(REPO / "configs" / name)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    # The printed summary is the resolved config and loads back to the same thing.
    resolved = yaml.safe_load(out.split("\n", 1)[1])
    assert load_config(REPO / "configs" / name).to_dict() == resolved


def test_embedded_profile_accumulates_micro_batches_of_16() -> None:
    cfg = load_config(REPO / "configs/embedded.yaml")
    assert cfg.training.micro_batch_size == 16
    assert cfg.training.global_batch_size > 16


def test_unknown_model_lists_the_known_names(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: small_cnnn}\ntraining: {epochs: 1}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "small_cnn" in err and "mobilenet_v2" in err


def test_kwarg_error_lists_what_the_factory_takes(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: small_cnn, kwargs: {widht: 8}}\ntraining: {epochs: 1}\n")
    assert main(["validate", str(path)]) == 2
    assert "width" in capsys.readouterr().err
