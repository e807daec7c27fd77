"""Governor vs bang-bang vs no control on the simulated plant (Orin Nano 8GB profile).

For each scenario and controller: training throughput relative to the best constant duty that
stays under the target (computed from the plant's steady state) and relative to the
time-optimal bound (full speed until the target, then hold it), time above the target,
maximum temperature, time in the board's own throttle, mean power, state changes. Prints one
table and saves a plot.

    python benchmarks/governor.py [--profile NAME] [--minutes 30] [--plot PATH] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # first: benchmarks/agent.py would shadow the package

from agent.sim.job import SimJobResult, simulate_job  # noqa: E402
from benchmarks.harness import parse_args, verdict  # noqa: E402
from device_profiles import load_profile  # noqa: E402
from device_profiles.schema import DeviceProfile  # noqa: E402

CONTROLS = ("governor", "bangbang", "none")


@dataclass(frozen=True)
class Scenario:
    name: str
    kwargs: dict[str, Any]
    controls: tuple[tuple[str, dict[str, Any]], ...] = tuple((c, {}) for c in CONTROLS)


def scenarios(minutes: float) -> list[Scenario]:
    half = minutes * 30.0
    return [
        Scenario("35 C enclosure, 15W", {"ambient_c": 35.0, "mode": "15W"}),
        Scenario(f"air 30 -> 40 C at {minutes / 2:g} min", {
            "ambient_c": 30.0, "mode": "15W", "ambient_schedule": [(half, 40.0)]}),
        Scenario("35 C, noisy sensor (0.5 C)", {"ambient_c": 35.0, "mode": "15W",
                                                "noise_c": 0.5}),
        Scenario("25 C air, 9 W power cap", {"ambient_c": 25.0, "mode": "15W",
                                             "power_cap_mw": 9000.0}),
        Scenario("35 C, starts in MAXN_SUPER", {"ambient_c": 35.0, "mode": "MAXN_SUPER"},
                 controls=(("governor", {}), ("governor", {"allow_mode_switch": True}),
                           ("bangbang", {}), ("none", {}))),
    ]


@dataclass
class Row:
    scenario: str
    control: str
    result: SimJobResult

    @property
    def mean_power_w(self) -> float:
        return self.result.energy_j / self.result.duration_s


def run_comparison(profile: DeviceProfile, minutes: float = 30.0, seed: int = 0) -> list[Row]:
    rows = []
    for sc in scenarios(minutes):
        for control, extra in sc.controls:
            kwargs = {"noise_c": 0.2, **sc.kwargs, **extra}
            result = simulate_job(profile, control=control,  # type: ignore[arg-type]
                                  duration_s=minutes * 60.0, seed=seed, **kwargs)
            label = control + (" + mode switch" if extra.get("allow_mode_switch") else "")
            rows.append(Row(sc.name, label, result))
    return rows


def format_table(rows: list[Row]) -> str:
    head = (f"{'scenario':<30} {'control':<24} {'vs const':>8} {'vs ideal':>8} {'>target s':>9} "
            f"{'max C':>6} {'throttled s':>11} {'mean W':>6} {'changes':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        res = r.result
        ideal = res.ideal_steps_per_s()
        vs_ideal = "-" if ideal is None else f"{res.steps_per_s / ideal:.3f}"
        lines.append(
            f"{r.scenario:<30} {r.control:<24} {res.relative_throughput():>8.3f} "
            f"{vs_ideal:>8} {res.time_above_target_s:>9.0f} "
            f"{res.max_temp_c:>6.1f} {res.board_throttled_s:>11.0f} {r.mean_power_w:>6.2f} "
            f"{len(res.events):>7d}"
        )
    return "\n".join(lines)


def _window_power(samples: list[dict[str, Any]], window_s: float = 10.0) -> tuple[list, list]:
    t, w = [], []
    start = samples[0]
    for s in samples[1:]:
        if s["t_s"] - start["t_s"] >= window_s:
            t.append(s["t_s"] / 60)
            w.append((s["energy_j"] - start["energy_j"]) / (s["t_s"] - start["t_s"]))
            start = s
    return t, w


def plot(rows: list[Row], path: Path, scenario: str) -> Path:
    from hpc_core.plots import figure, write_png

    chosen = [r for r in rows if r.scenario == scenario]
    fig = figure(figsize=(10, 9), layout="constrained")
    ax_t, ax_p, ax_s = fig.subplots(3, 1, sharex=True)
    colors = {"governor": "tab:blue", "bangbang": "tab:orange", "none": "tab:red"}
    first = chosen[0].result
    for r in chosen:
        s = r.result.samples
        t = [x["t_s"] / 60 for x in s]
        c = colors.get(r.control.split()[0], "gray")
        ax_t.plot(t, [x["temp_c"] for x in s], color=c, lw=1, label=r.control)
        ax_p.plot(*_window_power(s), color=c, lw=1, label=r.control)
        opt = r.result.optimum_steps_per_s()
        ax_s.plot(t, [x["steps"] / (opt * x["t_s"]) if x["t_s"] > 0 else 1.0 for x in s],
                  color=c, lw=1, label=r.control)
    ax_t.axhline(first.target_c, ls="--", color="gray", lw=1, label=f"target {first.target_c:g} C")
    ax_t.axhline(first.params.board_throttle_c, ls="-.", color="gray", lw=1,
                 label=f"board throttle {first.params.board_throttle_c:g} C")
    ax_t.set_ylabel("junction C")
    ax_t.set_title(f"Orin Nano 8GB plant, {scenario}: governor vs bang-bang vs no control")
    ax_t.legend(fontsize=8, loc="lower right")
    ax_p.set_ylabel("board W (10 s mean)")
    ax_p.legend(fontsize=8, loc="upper right")
    ax_s.axhline(1.0, ls="--", color="gray", lw=1)
    ax_s.set_ylabel("steps / best constant duty")
    ax_s.set_xlabel("simulated time (min)")
    ax_s.set_ylim(0.8, 1.8)
    return write_png(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="jetson-orin-nano-8gb")
    parser.add_argument("--minutes", type=float, default=30.0, help="simulated job length")
    parser.add_argument("--seed", type=int, default=0, help="sensor noise seed")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks/out/governor.png")
    args = parse_args(parser, {"minutes": 5.0,
                               "plot": Path(tempfile.gettempdir()) / "governor-quick.png"},
                      argv)
    profile = load_profile(args.profile)
    rows = run_comparison(profile, args.minutes, args.seed)
    print(f"profile {profile.name}, {args.minutes:g} simulated minutes per run, target "
          f"{profile.thermal.throttle_target_c:g} C, board throttle "
          f"{profile.thermal.board_throttle_c:g} C")
    print("vs const: steps/s over the best constant duty that stays under the target (and the "
          "cap) all job long, from the plant's steady state; vs ideal: over full speed until the "
          "target, then hold it (constant air, no cap)")
    print(format_table(rows))
    print(f"plot: {plot(rows, args.plot, rows[0].scenario)}")
    gov = [r for r in rows if r.control == "governor"]
    above = max(r.result.time_above_target_s for r in gov)
    verdict(f"governor steps/s over the best constant duty ({gov[0].scenario}) ratio",
            gov[0].result.relative_throughput(), ">=", 1.0,
            also=[("governor 0 s above the target in every scenario", above == 0)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
