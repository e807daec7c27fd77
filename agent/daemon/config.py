"""``edge-agent``'s configuration: ``/etc/edge-agent/agent.yaml``, then ``EDGE_AGENT_*`` overrides.

Environment overrides name the dotted path with ``__`` between levels, values parsed as YAML::

    EDGE_AGENT_DEVICE_ID=jetson-042  EDGE_AGENT_MQTT__PORT=8883  EDGE_AGENT_GROUPS='[lab, a]'

Unknown keys are errors (also in the environment), reported with their path and a hint.

This file (and provisioning) is the device's only source of trust and of where to talk: the
trusted keys, the signing key, the registry and upload target, the broker, the data root and
every path. A command names a data set or a cache; :meth:`AgentConfig.job_settings` turns this
config into what resolves those names (``agent.jobs.resolve.resolve``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.jobs.resolve import DeviceSettings
from agent.storage.trust import default_trusted_keys
from contract import DEFAULT_PREFIX, Topics, check_id
from hpc_core.config import ConfigError, apply_overrides, read_yaml
from registry.credentials import is_loopback
from registry.validation import format_errors

ENV_PREFIX = "EDGE_AGENT_"
DEFAULT_CONFIG = Path("/etc/edge-agent/agent.yaml")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    """Registry URL or folder the device pulls models from (deploy, a fine-tune's --version)."""
    upload_url: str | None = None
    """Where the device publishes its fine-tunes (null: url)."""
    token_file: Path | None = None
    """This device's own registry token (one line, mode 0600), sent only to url's origin, only
    over https (plain http to loopback only), only on requests that need it."""
    trusted_keys: Path | None = None
    """Folder of trusted ``*.pub.pem`` keys, owned by root or the service user and not
    group/world-writable (default: STATE_DIR/trusted_keys)."""
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
    max_queued_jobs: int = Field(default=16, ge=1)
    """Jobs waiting in the queue at most; a job command beyond it is REJECTED (UNAVAILABLE,
    retryable) and not stored."""
    defer_recheck_s: float | None = Field(default=60.0, ge=1, le=3600)
    """A ``deploy`` from the fleet (MQTT) that arrives while a finetune job runs or the
    governor throttles is answered DEFERRED, asking to be sent again after this many seconds
    (agent.daemon.deferral); null: queue it behind the running job instead."""
    keep_finished_jobs: int = Field(default=200, ge=10)
    """Finished jobs (and their folders and logs) kept, newest first; older ones are pruned.
    A command id repeated after its record was pruned runs again."""
    keep_history_s: float = Field(default=30 * 24 * 3600, gt=0)
    """Finished jobs and command records older than this (seconds) are pruned."""
    keep_command_records: int = Field(default=2000, ge=10)
    """Records of answered non-job commands (ping, cancel, ...) kept for DUPLICATE answers."""
    max_response_topic_bytes: int = Field(default=256, ge=16, le=4096)
    """Longest MQTT v5 ResponseTopic a command may ask the results to be copied to."""
    max_correlation_bytes: int = Field(default=256, ge=8, le=4096)
    """Longest MQTT v5 CorrelationData echoed back."""
    control_connections: int = Field(default=8, ge=1)
    """Control-socket clients served at once; one more is told so and closed."""
    control_timeout_s: float = Field(default=10.0, gt=0)
    """A control-socket client must send its request, and read each answer line, within this."""
    update_lock_max_wait_s: float = Field(default=300.0, ge=0)
    """Longest a commit waits while an application holds the model's update lock
    (``ActiveModel.hold_updates``, agent.runtime.update_lock); then it commits anyway, logged,
    and the application keeps serving its version until it lets go."""


class MetricsConfig(_Strict):
    """Prometheus metrics of the daemon (agent.daemon.metrics): off unless a port or a file
    is set."""

    port: int | None = Field(default=None, ge=0, le=65535)
    """Serve GET /metrics on this TCP port (null: no server; 0: any free port, logged)."""
    host: str = "127.0.0.1"
    """The port's address: loopback unless ``allow_remote`` (the endpoint has no auth)."""
    allow_remote: bool = False
    """Let ``host`` be a non-loopback address (a Prometheus on another machine scrapes it)."""
    textfile: Path | None = None
    """Also write the metrics to this file (node_exporter's textfile collector: a .prom file
    in its --collector.textfile.directory), replaced atomically at each refresh."""
    refresh_s: float = Field(default=5.0, gt=0)
    """Seconds between two readings of the sensors, jobs and outbox for the metrics."""

    @model_validator(mode="after")
    def _loopback(self) -> MetricsConfig:
        if not is_loopback(self.host) and not self.allow_remote:
            raise ValueError(f"metrics.host {self.host!r} is not loopback: the endpoint has no "
                             "auth; set metrics.allow_remote: true to serve it there")
        return self


MAX_SOCKET_PATH = 107
"""sun_path holds 108 bytes with the terminating NUL (Linux unix(7))."""


class AgentConfig(_Strict):
    device_id: str
    """This device's id: a topic level, the broker username and the certificate CN."""
    groups: list[str] = Field(default_factory=list)
    """Groups whose commands this device obeys (``{prefix}/group/{g}/cmd/+``)."""
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    state_dir: Path = Path("/var/lib/edge-agent")
    """Job store, outbox, model slots and keys live here (created 0700, files 0600)."""
    data_root: Path | None = None
    """Data sets a command may name (``data: cam0`` -> DATA_ROOT/cam0; default:
    STATE_DIR/data). Commands never carry paths."""
    control_socket: Path | None = None
    """The control socket agentctl talks to (default: STATE_DIR/agent.sock). Put it in a
    folder the admin group can enter (systemd: /run/edge-agent/agent.sock) for non-root
    operators: the state dir is 0700."""
    profile: str = "auto"
    """Device profile name, or auto (detected from the board)."""
    sensors: Literal["auto", "jtop", "tegrastats", "sysfs", "sim", "none"] = "auto"
    """Sensor backend for telemetry (none: telemetry without readings)."""
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    telemetry_s: float = Field(default=10.0, ge=0)
    """Seconds between telemetry messages (0: no telemetry)."""
    socket_group: str | None = "edge-agent"
    """Admin group: besides root and the service user, its members may use the control
    socket (mode 0660, checked per connection with SO_PEERCRED); null: nobody else."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    latency_slo_ms: float | None = Field(default=None, gt=0)
    """The application's inference p99 objective in ms: while a serving runtime on this device
    (``ActiveModel``, ``agentctl serve``) reports a p99 over it, fine-tuning yields (null: the
    SLO the application states, if any; with neither, training never yields)."""

    @field_validator("device_id")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_id(v, "device_id")

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        return [check_id(g, "group") for g in v]

    @model_validator(mode="after")
    def _absolute(self) -> AgentConfig:
        # The worker runs in the state dir, not the daemon's working directory: every path it
        # is handed must be absolute.
        self.state_dir = self.state_dir.absolute()
        for obj, name in ((self, "data_root"), (self, "control_socket"),
                          (self.registry, "trusted_keys"), (self.registry, "signing_key"),
                          (self.registry, "token_file"), (self.mqtt, "password_file"),
                          (self.metrics, "textfile")):
            value = getattr(obj, name)
            if value is not None:
                object.__setattr__(obj, name, value.absolute())
        sock = self.socket_path
        if len(os.fsencode(str(sock))) > MAX_SOCKET_PATH:
            field = "control_socket" if self.control_socket else "state_dir"
            raise ValueError(f"{field}: the control socket {sock} is longer than a Unix "
                             f"socket path may be ({MAX_SOCKET_PATH} bytes): set "
                             "control_socket to a shorter path (e.g. /run/edge-agent/agent.sock)")
        return self

    def job_settings(self) -> DeviceSettings:
        """What resolves a job command on this device: every path, registry and key."""
        return DeviceSettings(
            state_dir=self.state_dir, data_root=self.data_root or self.state_dir / "data",
            registry=self.registry.url, upload_registry=self.registry.upload_url,
            trusted_keys=self.trusted_keys_dir, signing_key=self.signing_key_path,
            # The board this daemon runs on and the sensors it reads pace the fine-tune too.
            profile=self.profile, sensors=self.sensors, latency_slo_ms=self.latency_slo_ms,
            update_lock_max_wait_s=self.limits.update_lock_max_wait_s,
        )

    @property
    def trusted_keys_dir(self) -> Path:
        return self.registry.trusted_keys or default_trusted_keys(self.state_dir)

    @property
    def signing_key_path(self) -> Path:
        return self.registry.signing_key or self.state_dir / "device.key.pem"

    @property
    def socket_path(self) -> Path:
        return self.control_socket or self.state_dir / "agent.sock"

    def check_files(self) -> list[str]:
        """Problems with the files this config trusts, one line each naming the key and the
        path: secrets open to group or others, a trusted-keys folder or broker CA anyone else
        could write.
        Missing optional files (no device key yet, no trusted keys yet) are not problems."""
        from agent.storage.trust import check_secret_file, check_trusted_dir, check_trusted_file
        from registry.errors import KeyFileError

        secrets = [("mqtt.password_file", self.mqtt.password_file),
                   ("mqtt.tls.key", self.mqtt.tls.key if self.mqtt.tls else None),
                   ("registry.token_file", self.registry.token_file),
                   ("registry.signing_key", self.registry.signing_key)]
        if self.registry.signing_key is None and self.signing_key_path.exists():
            secrets.append(("registry.signing_key", self.signing_key_path))
        problems = []
        for key, path in secrets:
            if path is None:
                continue
            try:
                check_secret_file(path, "secret")
            except KeyFileError as e:
                problems.append(f"  {key}: {e}")
        if self.mqtt.tls is not None:
            try:  # the broker's CA decides whom the device takes commands from
                check_trusted_file(self.mqtt.tls.ca, "CA bundle")
            except KeyFileError as e:
                problems.append(f"  mqtt.tls.ca: {e}")
        if self.registry.trusted_keys is not None or self.trusted_keys_dir.exists():
            try:
                check_trusted_dir(self.trusted_keys_dir)
            except KeyFileError as e:
                problems.append(f"  registry.trusted_keys: {e}")
        return problems

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
