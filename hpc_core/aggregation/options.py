"""What one aggregation round was asked to do, checked before anything is read."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpc_core.aggregation.privacy import DpSettings
from hpc_core.aggregation.strategies import STRATEGIES, Strategy
from registry.errors import UsageError

DEFAULT_TRIM = 0.2
DEFAULT_KRUM_F = 1
DEFAULT_MIN_UPDATES = 2
MEDIAN_CLIP = "median"
"""``--clip-norm median``: the bound is the round's median update norm."""
MAX_SERVER_LR = 100.0
"""A server step beyond this is a typo, not a method: nothing published should move a model
a hundred times further than its devices did."""


@dataclass(frozen=True)
class Options:
    registry: str
    model: str
    base: str
    strategy: Strategy
    trusted_keys: Path
    out: Path
    updates: list[str] | None = None
    """Device versions to combine; None: every version the (folder) registry lists."""
    trim: float = DEFAULT_TRIM
    """trimmed-mean: fraction of values dropped at each end of each coordinate."""
    krum_f: int = DEFAULT_KRUM_F
    """krum: Byzantine updates tolerated."""
    krum_keep: int = 1
    """krum: the best-scored updates averaged (1: Krum; more: Multi-Krum)."""
    clip_norm: float | Literal["median"] | None = None
    """Clip each update's delta to this L2 norm (over the whole update); "median": to the
    median of this round's update norms (norm bounding without a number to guess: with fewer
    than half the updates bad, the bound is an honest update's norm)."""
    server_lr: float = 1.0
    """The aggregate is base + server_lr x the combined delta (FedAvg with a server learning
    rate, Reddi et al. 2021): 1 is plain averaging."""
    dp: DpSettings | None = None
    min_updates: int = DEFAULT_MIN_UPDATES
    max_staleness: int = 0
    """Upstream releases an update's release may lie behind the base."""
    block_mb: float | None = None
    """MiB of one N x block float32 array; None: an eighth of the model, 1 to 64 MiB."""
    work_dir: Path | None = None
    """Where chunks of a remote registry are cached during the run (default: beside --out)."""

    def check(self) -> None:
        """UsageError (exit 2) naming the option and the fix."""
        if self.strategy not in STRATEGIES:
            raise UsageError(f"--strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if not 0.0 <= self.trim < 0.5:
            raise UsageError(f"--trim {self.trim}: a fraction in [0, 0.5) dropped at each end")
        if self.krum_f < 0:
            raise UsageError(f"--krum-f {self.krum_f}: the number of bad updates, >= 0")
        if self.krum_keep < 1:
            raise UsageError(f"--krum-keep {self.krum_keep}: the updates averaged, >= 1 (1: "
                             "Krum's single pick)")
        clip = self.clip_norm
        if clip not in (None, MEDIAN_CLIP) and not (
                isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
            raise UsageError(f"--clip-norm {clip}: a positive L2 norm or {MEDIAN_CLIP!r}")
        if not (math.isfinite(self.server_lr) and 0 < self.server_lr <= MAX_SERVER_LR):
            raise UsageError(f"--server-lr {self.server_lr}: a step in (0, {MAX_SERVER_LR:g}] "
                             "(1: plain averaging)")
        if self.min_updates < 1 or self.max_staleness < 0:
            raise UsageError("--min-updates must be >= 1 and --max-staleness >= 0")
        if self.block_mb is not None and not 0 < self.block_mb <= 4096:
            raise UsageError(f"--block-mb {self.block_mb}: between 0 and 4096 MiB")
        if self.out.exists():
            raise UsageError(f"--out {self.out} exists: the aggregate is written to a new folder")
        if self.dp is not None:
            self._check_dp(self.dp)

    def _check_dp(self, dp: DpSettings) -> None:
        if self.clip_norm is None:
            raise UsageError("--dp-noise-multiplier needs --clip-norm: the noise is scaled to "
                             "the clipped updates' sensitivity")
        if isinstance(self.clip_norm, str):
            raise UsageError(f"--dp-noise-multiplier needs a fixed --clip-norm C, not "
                             f"{self.clip_norm}: a bound taken from the updates themselves "
                             "bounds no device's influence in advance, so no noise is "
                             "calibrated to it")
        if self.strategy != "fedavg":
            raise UsageError(f"--dp-noise-multiplier works with --strategy fedavg only: "
                             f"{self.strategy} has no simple sensitivity bound to calibrate "
                             "noise to")
        if not (math.isfinite(dp.noise_multiplier) and dp.noise_multiplier > 0):
            raise UsageError(f"--dp-noise-multiplier {dp.noise_multiplier}: must be > 0")
        if not 0 < dp.delta < 1:
            raise UsageError(f"--dp-delta {dp.delta}: must be in (0, 1), e.g. 1e-5 (below 1 / "
                             "the number of devices)")
        if dp.rounds < 1:
            raise UsageError(f"--dp-rounds {dp.rounds}: at least 1")
        if not (math.isfinite(dp.expected_weight) and dp.expected_weight > 0):
            raise UsageError(f"--dp-expected-weight {dp.expected_weight}: the total weight a "
                             "round is expected to bring, > 0 (each update weighs at most 1: "
                             "with equal weights, the number of updates expected)")
        if dp.weight_cap is not None and not (math.isfinite(dp.weight_cap)
                                              and dp.weight_cap > 0):
            raise UsageError(f"--dp-weight-cap {dp.weight_cap}: the sample count at which a "
                             "device's weight reaches 1, > 0")
        if importlib.util.find_spec("dp_accounting") is None:
            raise UsageError("--dp-noise-multiplier needs the dp-accounting package for its "
                             "(epsilon, delta): pip install -e '.[learn]'")

    def block_bytes(self, model_bytes: int) -> int:
        if self.block_mb is not None:
            return int(self.block_mb * (1 << 20))
        return int(min(64 << 20, max(1 << 20, model_bytes // 8)))

    def params(self) -> dict[str, Any]:
        """The options as the report records them."""
        out: dict[str, Any] = {
            "registry": self.registry, "updates": self.updates or "auto",
            "min_updates": self.min_updates, "max_staleness": self.max_staleness,
            "clip_norm": self.clip_norm, "block_mb": self.block_mb,
            "server_lr": self.server_lr,
        }
        if self.strategy == "trimmed-mean":
            out["trim"] = self.trim
        if self.strategy == "krum":
            out["krum_f"] = self.krum_f
            out["krum_keep"] = self.krum_keep
        return out
