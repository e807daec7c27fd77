"""Power-mode switching: which nvpmodel mode gives the most steps/s inside a power envelope.

When throttled, a lower-clocked mode can deliver more steps per second inside the same power
envelope (voltage falls with frequency). The governor decides when to ask (rarely, once
settled); this module predicts each mode's rate from the profile, corrected by the power this
board measures in its current mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from device_profiles.schema import DeviceProfile


class PowerModeSwitcher(Protocol):
    """``nvpmodel`` on a board (``device_profiles.nvpmodel``), the plant in simulation."""

    def current(self) -> str | None: ...

    def available(self) -> list[str]: ...

    def switch(self, name: str) -> None: ...


@dataclass(frozen=True)
class ModeChoice:
    mode: str
    gain_pct: float
    """Predicted steps/s gain over the current mode (inf when the current one is stalled)."""
    duty: float
    """Duty predicted to hold the same power in the new mode (for a bumpless hand-over)."""
    active_mw: float
    """Predicted power while computing in the new mode."""


def choose_mode(
    profile: DeviceProfile,
    current: str,
    available: list[str],
    *,
    active_mw: float,
    idle_mw: float,
    allowed_mw: float,
    min_gain: float,
) -> ModeChoice | None:
    """The best mode other than ``current`` if it beats it by ``min_gain``, else None."""
    # Correct the profile's power estimates by what this board measures in this mode.
    bias = active_mw / (profile.load_power_w(current) * 1000.0)

    def predicted(name: str) -> tuple[float, float]:
        mode_mw = profile.load_power_w(name) * 1000.0 * bias
        if mode_mw <= allowed_mw:
            return profile.relative_speed(name), 1.0
        duty = min(1.0, max(0.0, (allowed_mw - idle_mw) / (mode_mw - idle_mw)))
        return profile.relative_speed(name) * duty, duty

    candidates = [m for m in available if m != current and not profile.mode(m).needs_reboot]
    if not candidates:
        return None
    now_rate, _ = predicted(current)
    best = max(candidates, key=lambda m: predicted(m)[0])
    best_rate, best_duty = predicted(best)
    if now_rate > 0 and best_rate < now_rate * (1.0 + min_gain):
        return None
    gain = (best_rate / now_rate - 1.0) * 100 if now_rate > 0 else math.inf
    return ModeChoice(best, gain, best_duty, profile.load_power_w(best) * 1000.0 * bias)
