"""``edge-agent``'s configuration: ``/etc/edge-agent/agent.yaml``, then ``EDGE_AGENT_*`` overrides.

Environment overrides name the dotted path with ``__`` between levels, values parsed as YAML::

    EDGE_AGENT_DEVICE_ID=jetson-042  EDGE_AGENT_MQTT__PORT=8883  EDGE_AGENT_GROUPS='[lab, a]'

Unknown keys are errors (also in the environment), reported with their path and a hint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.mqtt.contract import DEFAULT_PREFIX, Topics, check_id
from hpc_core.config import ConfigError, apply_overrides, format_errors, read_yaml

ENV_PREFIX = "EDGE_AGENT_"
DEFAULT_CONFIG = Path("/etc/edge-agent/agent.yaml")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TlsConfig(_Strict):
    ca: Path
    """CA bundle that signed the broker's certificate (PEM)."""
    cert: Path | None = None
    """This device's client certificate (PEM) for mutual TLS; its CN is the device id."""
    key: Path | None = None
    """The client certificate's private key (PEM, mode 0600)."""

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls.cert and tls.key go together: set both or neither")
        return self


class MqttConfig(_Strict):
    host: str = "localhost"
    port: int = Field(default=1883, ge=1, le=65535)
    tls: TlsConfig | None = None
    """Set to connect with TLS (port 8883 by convention)."""
    username: str | None = None
    """Broker username (default: the device id when a password file is set)."""
    password_file: Path | None = None
    """File holding the broker password (one line); keeps the secret out of this YAML."""
    keepalive_s: int = Field(default=30, ge=5, le=3600)
    prefix: str = DEFAULT_PREFIX
    """Topic prefix shared with the fleet (``{prefix}/dev/{id}/...``)."""
    session_expiry_s: int = Field(default=7 * 24 * 3600, ge=60)
    """How long the broker keeps this device's session (and commands sent to it) while it is
    offline."""
    reconnect_min_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=60.0, gt=0)
    """Reconnect back-off doubles from min to max, with full jitter."""

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        Topics(v)
        return v


class RegistryConfig(_Strict):
    url: str | None = None
    """Registry URL or folder the device pulls models from."""
    trusted_keys: Path | None = None
    """Folder of trusted ``*.pub.pem`` keys (default: STATE_DIR/trusted_keys)."""
    signing_key: Path | None = None
    """This device's private key: signs the models it fine-tunes, stages and uploads (default:
    the job's, STATE_DIR/device.key.pem). Its file name is the signer's name and uploads are
    named PARENT+SIGNER.STAMP: make it with ``hpc-train keygen --name DEVICE_ID --scope
    'MODEL@*+DEVICE_ID.*'`` so the registry can tell devices apart and scope each key."""


class LimitsConfig(_Strict):
    max_job_attempts: int = Field(default=3, ge=1)
    """A job whose worker crashes is resumed up to this many times, then FAILED (INTERNAL)."""
    default_job_timeout_s: float | None = Field(default=None, gt=0)
    """Timeout for jobs whose command sets none (null: no limit)."""
    stop_grace_s: float = Field(default=20.0, gt=0)
    """On SIGTERM, how long the running job gets to checkpoint before it is killed (systemd
    kills the daemon at TimeoutStopSec=30)."""
    cancel_grace_s: float = Field(default=30.0, gt=0)
    """A running job that ignores a cancel (or a timeout) this long is killed."""
    progress_interval_s: float = Field(default=1.0, ge=0)
    """Smallest gap between two IN_PROGRESS results of one job."""
    job_history: int = Field(default=500, ge=10)
    """Jobs checked at start-up for results that were persisted but never announced."""


class AgentConfig(_Strict):
    device_id: str
    """This device's id: a topic level, the broker username and the certificate CN."""
    groups: list[str] = Field(default_factory=list)
    """Groups whose commands this device obeys (``{prefix}/group/{g}/cmd/+``)."""
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    state_dir: Path = Path("/var/lib/edge-agent")
    """Job store, outbox, model slots and the control socket live here."""
    profile: str = "auto"
    """Device profile name, or auto (detected from the board)."""
    sensors: Literal["auto", "jtop", "tegrastats", "sysfs", "sim", "none"] = "auto"
    """Sensor backend for telemetry (none: telemetry without readings)."""
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    telemetry_s: float = Field(default=10.0, ge=0)
    """Seconds between telemetry messages (0: no telemetry)."""
    socket_group: str | None = "edge-agent"
    """Group that may use the control socket (mode 0660); null keeps the daemon's own group."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @field_validator("device_id")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_id(v, "device_id")

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        return [check_id(g, "group") for g in v]

    def job_defaults(self) -> dict[str, Any]:
        """What a job command leaves out and this device knows: filled in before validation."""
        return {
            "registry": self.registry.url,
            "trusted_keys": str(self.registry.trusted_keys or self.state_dir / "trusted_keys"),
            "signing_key": str(self.registry.signing_key) if self.registry.signing_key else None,
            # The board this daemon runs on and the sensors it reads pace the fine-tune too.
            "finetune": {"profile": self.profile, "sensors": self.sensors},
        }

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "agent.sock"

    @property
    def topics(self) -> Topics:
        return Topics(self.mqtt.prefix)


def env_overrides(environ: Mapping[str, str]) -> list[str]:
    """``EDGE_AGENT_MQTT__PORT=8883`` -> ``mqtt.port=8883``, in a stable order."""
    out = []
    for key in sorted(environ):
        if key.startswith(ENV_PREFIX) and key not in ("EDGE_AGENT_CONFIG",):
            path = key[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append(f"{path}={environ[key]}")
    return out


def load_agent_config(
    path: Path | None, environ: Mapping[str, str] | None = None, overrides: list[str] = ()
) -> AgentConfig:
    """Read the YAML (if any), apply the environment then ``overrides``; ConfigError lists
    every problem with its dotted path."""
    environ = os.environ if environ is None else environ
    tree = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "(environment)"
    tree = apply_overrides(tree, [*env_overrides(environ), *overrides])
    try:
        return AgentConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(source, format_errors(e, AgentConfig)) from None


__all__ = ["AgentConfig", "ConfigError", "load_agent_config"]
