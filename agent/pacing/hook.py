"""``GovernorHook``: pacing as an ``hpc_core.Trainer`` hook, for any ``DutyController``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.pacing.controller import (
    AppLatency,
    Clock,
    Decision,
    DutyController,
    GovernorState,
    MonotonicClock,
)
from agent.pacing.power_modes import PowerModeSwitcher
from agent.sensors import SensorBackend


@dataclass
class PacingRecord:
    """What the hook saw, for the job report."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    compute_s: float = 0.0
    paced_s: float = 0.0
    waited_s: float = 0.0
    yielded_s: float = 0.0
    """Of paced_s + waited_s: while the application's latency set the duty."""
    worst_p99_ms: float | None = None
    """The worst application p99 reported during the run."""
    fewer_threads_s: float = 0.0
    """Training time spent on fewer intra-op threads because the application was over its
    SLO (cores yielded before time)."""


@dataclass
class ThreadYield:
    """The trainer's intra-op threads, handed to the application while it is over its SLO.

    Duty-cycle pacing lowers how often a request meets a training step, not what meeting one
    costs: a step on every core still stalls each request that arrives during it, and p99 is
    set by those once more than 1 in 100 do. So while the latency loop constrains, training
    first gives up ``give`` cores (it runs on ``full - give`` threads, at least one). It takes
    them back after ``hold_s`` without a constraint, and at once when nobody reports (nothing
    to yield to). A p99 that breaks the SLO again within the hold after they came back says
    the application needs them: the hold doubles (up to ``max_hold_s``), so a steady
    application is not handed its cores and robbed of them every window."""

    set_threads: Callable[[int], None]
    full: int
    give: int = 1
    hold_s: float = 30.0
    max_hold_s: float = 600.0
    reduced: bool = False
    last_constrained_s: float = -math.inf
    restored_s: float = -math.inf
    hold_now_s: float = field(init=False)
    """The hold in force: ``hold_s``, doubled each time the cores came back too soon."""

    def __post_init__(self) -> None:
        self.hold_now_s = self.hold_s

    def update(self, constrained: bool, serving: bool, now: float) -> None:
        if not serving:
            self.hold_now_s = self.hold_s
        if constrained:
            if not self.reduced and now - self.restored_s < self.hold_now_s:
                self.hold_now_s = min(2 * self.hold_now_s, self.max_hold_s)
            self.last_constrained_s = now
        want = serving and (constrained or (
            self.reduced and now - self.last_constrained_s < self.hold_now_s))
        if want != self.reduced and self.full > 1:
            self.set_threads(max(1, self.full - self.give) if want else self.full)
            self.reduced = want
            if not want:
                self.restored_s = now


class GovernorHook:
    """``TrainerHook`` that reads the sensors after every optimizer step, asks the controller
    for a duty and sleeps the matching pause through the injected clock.

    PAUSED: with ``on_pause="wait"`` the hook checkpoints (``trainer.save()``) and then sleeps,
    polling the sensors every ``poll_s``, until the controller lets training resume (giving up
    with ``trainer.request_stop`` after ``max_wait_s``); with ``on_pause="stop"`` it asks the
    trainer to checkpoint and return at once, for a supervisor to restart later."""

    def __init__(
        self,
        controller: DutyController,
        sensors: SensorBackend,
        *,
        clock: Clock | None = None,
        on_pause: Literal["wait", "stop"] = "wait",
        poll_s: float = 1.0,
        max_wait_s: float = 3600.0,
        idle_read_min_s: float = 0.02,
        record_every_s: float = 1.0,
        power_mode: PowerModeSwitcher | None = None,
        latency: Callable[[], AppLatency | None] | None = None,
        threads: ThreadYield | None = None,
    ) -> None:
        self.controller = controller
        self.latency = latency
        self.threads = threads
        self._serving = False
        self.sensors = sensors
        self.clock: Clock = clock or MonotonicClock()
        self.on_pause = on_pause
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.idle_read_min_s = idle_read_min_s
        self.record_every_s = record_every_s
        self.power_mode = power_mode
        self.record = PacingRecord()
        self.last: Decision | None = None
        self.start_s = self.clock.now()
        # Unknown until the first step ends: the first step also carries loader start-up.
        self._resumed_at: float | None = None
        self._last_sample_s = -math.inf
        self._last_metrics_s = -math.inf
        self._idle_mw: float | None = None
        self._window_mj = 0.0
        self._window_s = 0.0

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        now = self.clock.now()
        step_s = 0.0 if self._resumed_at is None else max(0.0, now - self._resumed_at)
        self.record.steps += 1
        self.record.compute_s += step_s
        reading = self.sensors.read()
        decision = self.last = self.controller.update(reading, now, "active", self._latency())
        self._account(reading.total_power_mw, step_s)
        if self.threads is not None:
            if self.threads.reduced:
                self.record.fewer_threads_s += step_s
            self.threads.update(decision.limit == "latency", self._serving, now)
        self._record_metrics(now, step, metrics)
        if decision.state == GovernorState.PAUSED and self.on_pause == "stop":
            trainer.request_stop(f"governor paused: {self._last_reason()}")
        elif decision.duty <= 0.0:
            if decision.state == GovernorState.PAUSED and hasattr(trainer, "save"):
                trainer.save()  # the next thing past the soft limit is the board's own throttle
            self._sample(self.clock.now(), step, decision)
            self._wait(trainer, step)
        elif decision.duty < 1.0 and step_s > 0:
            pause = step_s * (1.0 - decision.duty) / decision.duty
            self.clock.sleep(pause)
            self.record.paced_s += pause
            if decision.limit == "latency":
                self.record.yielded_s += pause
            idle_mw = None
            if pause >= self.idle_read_min_s:
                idle = self.sensors.read()
                self.controller.update(idle, self.clock.now(), "idle", self._latency())
                idle_mw = idle.total_power_mw
            self._account(idle_mw if idle_mw is not None else self._idle_mw, pause, idle=True)
        self._sample(self.clock.now(), step, decision)
        self._resumed_at = self.clock.now()

    def _wait(self, trainer: Any, step: int) -> None:
        waited = 0.0
        while True:
            self.clock.sleep(self.poll_s)
            waited += self.poll_s
            now = self.clock.now()
            reading = self.sensors.read()
            decision = self.last = self.controller.update(reading, now, "idle", self._latency())
            if decision.limit == "latency":
                self.record.yielded_s += self.poll_s
            self._account(reading.total_power_mw, self.poll_s, idle=True)
            self._sample(now, step, decision)
            if decision.duty > 0.0 and decision.state != GovernorState.PAUSED:
                break
            if waited >= self.max_wait_s:
                trainer.request_stop(f"governor waited {waited:.0f} s without cooling down")
                break
        self.record.waited_s += waited

    def _latency(self) -> AppLatency | None:
        if self.latency is None:
            return None
        report = self.latency()
        self._serving = report is not None
        if report is not None and (self.record.worst_p99_ms is None
                                   or report.p99_ms > self.record.worst_p99_ms):
            self.record.worst_p99_ms = report.p99_ms
        return report

    def _account(self, power_mw: float | None, seconds: float, idle: bool = False) -> None:
        """Energy of the sample window: a reading after a step stands for that step, one
        after a pause for the pause (the last idle reading when the pause was too short)."""
        if idle and power_mw is not None:
            self._idle_mw = power_mw
        if power_mw is not None and seconds > 0:
            self._window_mj += power_mw * seconds
            self._window_s += seconds

    def _last_reason(self) -> str:
        events = self.controller.events
        return events[-1].reason if events else "soft limit"

    def _sample(self, now: float, step: int, d: Decision) -> None:
        if now - self._last_sample_s < self.record_every_s:
            return
        self._last_sample_s = now
        avg_mw = self._window_mj / self._window_s if self._window_s > 0 else d.power_mw
        self._window_mj = self._window_s = 0.0
        self.record.samples.append({
            "t_s": now - self.start_s,
            "step": step,
            "temp_c": d.temp_c,
            "zone": d.zone,
            "power_mw": avg_mw,
            "power_now_mw": d.power_mw,
            "duty": d.duty,
            "state": d.state.value,
            "limit": d.limit,
            "power_mode": self.power_mode.current() if self.power_mode else None,
            "app_p99_ms": getattr(self.controller, "last_p99_ms", None),
        })

    def _record_metrics(self, now: float, step: int, metrics: dict[str, float]) -> None:
        evaluated = any(k.startswith("eval/") for k in metrics)
        if evaluated or now - self._last_metrics_s >= self.record_every_s:
            self._last_metrics_s = now
            self.record.metrics.append({"t_s": now - self.start_s, "step": step, **metrics})
