"""What the daemon reports about its board, torch-free: boot id, active model, readings, modes.

Sensor reads and model lookups run on the main loop (telemetry) and in the ``status`` command;
each degrades to "unknown" rather than failing the message it feeds.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from contract import GovernorInfo, MemInfo, ModelInfo

log = logging.getLogger("agent.daemon")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def agent_version() -> str:
    try:
        return metadata.version("edgetrain")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def models_fingerprint(state_dir: Path) -> tuple[tuple[str, str, int], ...]:
    """What changes when any model's active version does (a commit, a rollback, a pull):
    each model's ``current`` link target and its manifest's mtime. Cheap enough to read every
    turn of the main loop, so the retained status follows the model without parsing a
    manifest per turn."""
    root = state_dir / "models"
    out = []
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir())
    except OSError:
        return ()
    for name in names:
        current = root / name / "current"
        try:
            target = os.readlink(current)
            mtime = (current / "manifest.json").stat().st_mtime_ns
        except OSError:
            target, mtime = "", 0
        out.append((name, target, mtime))
    return tuple(out)


def active_model(state_dir: Path) -> ModelInfo | None:
    """The active slot of the installed model (the first by name when there are several)."""
    from agent.storage.slots import ModelSlots

    root = state_dir / "models"
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir())
    except OSError:
        return None
    for name in names:
        try:
            active = ModelSlots(state_dir, name).active()
        except Exception as e:  # a corrupt slot must not take the status message down
            log.warning("model %s: cannot read its active slot: %s", name, e)
            continue
        if active is not None:
            return ModelInfo(name=name, version=active.version,
                             sequence=getattr(active.manifest, "sequence", None),
                             slot=active.slot)  # type: ignore[arg-type]
    return None


class Sensors:
    """The configured sensor backend, opened on first use; ``none`` reads nothing.

    ``state_dir``: with ``sim``, the device's one simulated board, which its fine-tunes heat
    and whose profile and time scale they set (``agent.sensors.sim.SimBoard``); without it the
    daemon would read a board of its own that no job ever heats."""

    def __init__(self, name: str, *, state_dir: Path | None = None) -> None:
        self.name = name
        self.state_dir = state_dir
        self._backend: Any = None

    def read(self) -> dict[str, Any]:
        if self.name == "none":
            return {}
        try:
            if self._backend is None:
                from agent.sensors import open_sensors

                self._backend = open_sensors(self.name, state_dir=self.state_dir)
            r = self._backend.read()
        except Exception as e:
            log.warning("sensor read failed: %s", e)
            return {}
        out: dict[str, Any] = {"temps_c": dict(r.temps_c), "power_mw": r.total_power_mw,
                               "gpu_util": r.gpu_load_pct}
        if r.ram_used_mb is not None and r.ram_total_mb is not None:
            out["mem"] = MemInfo(used_mb=round(r.ram_used_mb, 1),
                                 total_mb=round(r.ram_total_mb, 1))
        return out

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()


def governor_of(progress: dict[str, Any] | None) -> GovernorInfo | None:
    """The fine-tune's pacing state, when the job's progress carries one: the fine-tune child
    writes ``detail = {"governor": STATE, "duty": d, "limit": "thermal"|..., "temp_c": t}``
    (the limit that sets the duty is the reason); a ``{"state", "duty", "reason"}`` mapping
    under ``governor`` is read as is."""
    detail = (progress or {}).get("detail") or {}
    gov = detail.get("governor")
    if isinstance(gov, str):
        gov = {"state": gov, "duty": detail.get("duty"), "reason": detail.get("limit")}
    if isinstance(gov, dict) and "state" in gov:
        try:
            return GovernorInfo.model_validate(
                {k: gov[k] for k in ("state", "duty", "reason") if gov.get(k) is not None})
        except Exception:
            return None
    return None


def set_power_mode(mode: str) -> tuple[str, dict[str, Any]]:
    """(status, result or error) for the set_power_mode command: nvpmodel as root, else the
    jtop service (``device_profiles.nvpmodel.mode_setter``)."""
    from device_profiles import nvpmodel

    setter, how = nvpmodel.mode_setter()
    if setter is None:
        return "FAILED", {"code": "UNAVAILABLE", "retryable": False,
                          "message": f"cannot switch power modes: {how}"}
    try:
        info = nvpmodel.read_modes()
        mode_id = info.id_of(mode)
        if mode_id is None:
            return "FAILED", {"code": "BAD_ARGS", "retryable": False,
                              "message": f"args.mode: {mode!r} is not a power mode of this board"}
        setter.set(mode_id)
    except Exception as e:
        return "FAILED", {"code": "UNAVAILABLE", "message": str(e)[:500], "retryable": True}
    return "SUCCEEDED", {"mode": mode, "id": mode_id, "via": setter.name}
