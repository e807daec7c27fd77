"""``fleetctl learn``: rounds of fleet learning over a group, one resumable state machine.

A round, from its base release B (round 1: the plan's base; later: the last release)::

    finetune --collected--> aggregate --done--> candidate --published--> evaluate --done-->
        publish --published--> deploy --done|skip--> done
    finetune --too_few--> done (skipped)      aggregate --too_few--> done (skipped)
    candidate --refused--> done (refused)     publish --refused--> done (refused)

- **finetune**: a rollout ``NAME-rK-ft`` of ``finetune`` (version B, ``steps.upload``) in the
  plan's waves. The round goes on as soon as ``min_updates`` devices' uploads are in (fresh
  ones, and late ones of earlier rounds within ``max_staleness``: FedBuff), or gives up at
  ``collect_s`` (or when its rollout ended) with fewer: skipped, B kept (``fleet.learn.quorum``
  decides). It never waits for an offline or slow device: that rollout goes on under the
  controller, and what it uploads later counts in a later round, with its staleness
  (``--max-staleness`` is passed through).
- **aggregate**: ``hpc-train aggregate --updates V1,...`` of exactly the uploads chosen: per
  device its freshest one not spent by an earlier round; wrong ones are refused
  (``fleet.learn.updates`` decides).
- **candidate** / **evaluate** / **publish**: see "Where the candidate lives" below.
- **deploy** (``--deploy``): a rollout ``NAME-rK-dp`` of ``deploy`` of the new release.

Where the candidate lives. A device evaluates only what its own registry serves, signed by a
key it trusts (a command names no registry, by design), so the candidate is published into
that registry first, as ``PREFIX-rK-candidate`` (behind the upstream gate, if set), and
scored by every device beside B (rollout ``NAME-rK-ev``, ``evaluate.baseline`` = B). Then
the same aggregate is published again as the release ``PREFIX-rK``, by ``hpc-train publish``
with the device-evals file and the device gates (``fleet.learn.gates``): if one fails, nothing
is published (exit 4) and the round keeps B, with the gate figures as its reason. Why this
and not "publish ``--dry-run``, then promote the candidate": a release name then exists only
for an aggregate that passed every gate, with the gates' figures signed into its manifest
(``gate/...``); no deploy ever names a candidate (the learn deploys releases only, and a
candidate is only ever evaluated, which installs nothing); the second publish costs one
manifest, its chunks are already there. A refused candidate stays in the registry, unused:
versions are immutable.

Restarts. The round's record (``fleet.learn.store``) is written at every phase change, and
before each action that would cost something twice (a tool's start is counted in
``tool_runs`` before it starts). Each phase's action is idempotent: rollouts have
deterministic names and are adopted when found (their executions keep their ids: devices
answer DUPLICATE), an aggregate folder is complete or absent, a publish started again is
refused by the registry when the first one got there ("already exists": taken as done, for a
version this round had started publishing), and the device-evals file is rewritten from the
record. So a controller killed at any point resumes the phase it was in without running a
finished one again; only a tool killed mid-run (it dies with the controller:
``fleet.learn.child``) runs again.

The driver runs inside the rollout controller's loop (``fleet.learn.loop.drive``): the same
``Controller`` drives the learn's rollouts, every other active rollout of the db, and the
learns.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from fleet.learn.evaluations import EVALS_FILE, read_evaluations, write_device_evals
from fleet.learn.gates import PublishVerdict, publish_verdict, refusal_reason
from fleet.learn.plan import Phase
from fleet.learn.quorum import aggregate_skip_reason, has_quorum, skip_reason
from fleet.learn.store import LEARN_ACTIVE, Learn, LearnStore, RoundState
from fleet.learn.updates import History, collect_updates
from fleet.learn.upstream import (
    ToolRun,
    UpstreamError,
    aggregate_argv,
    candidate_argv,
    read_aggregate,
    read_gates,
    release_argv,
)
from fleet.rollout.controller import Controller
from fleet.rollout.report import load_run
from fleet.rollout.run import RolloutRun
from fleet.rollout.store import ROLLOUT_FINAL

log = logging.getLogger("fleet.learn")

TRANSITIONS: dict[tuple[str, str], str] = {
    ("finetune", "collected"): "aggregate",
    ("finetune", "too_few"): "done",
    ("aggregate", "done"): "candidate",
    ("aggregate", "too_few"): "done",
    ("candidate", "published"): "evaluate",
    ("candidate", "refused"): "done",
    ("evaluate", "done"): "publish",
    ("publish", "published"): "deploy",
    ("publish", "refused"): "done",
    ("deploy", "done"): "done",
    ("deploy", "skip"): "done",
}
"""(phase, event) -> next phase: the whole round on one screen."""


class LearnDriver:
    """Advances every running learn one step per turn of the controller's loop."""

    def __init__(self, learns: LearnStore, ctl: Controller, hpc_train: list[str],
                 work_root: Path, *, tick_s: float = 0.25) -> None:
        self.learns = learns
        self.store = learns.store
        self.ctl = ctl
        self.hpc_train = hpc_train
        self.work_root = work_root
        self.tick_s = tick_s
        self.only: set[str] | None = None
        self.active: dict[str, Learn] = {}
        self.driven: list[str] = []
        """Every learn this driver took up, in order."""
        self.current: dict[str, RoundState] = {}
        self.history: dict[str, History] = {}
        self.tools: dict[tuple[str, int, str], ToolRun] = {}
        self._next_tick = 0.0

    # --- which learns -------------------------------------------------------------------

    def select(self, learn_ids: list[str] | None) -> None:
        """Drive these learns (None: every running one, and those started later)."""
        self.only = set(learn_ids) if learn_ids else None
        self.refresh()

    def refresh(self) -> None:
        replica = self.ctl.replica
        if replica is not None:  # one of several controllers: drive the learns we lease
            for lid in [x for x in self.active if f"learn:{x}" not in replica.held]:
                self.active.pop(lid)
        for learn in self.learns.learns(LEARN_ACTIVE):
            if learn.id not in self.active and (self.only is None or learn.id in self.only):
                if replica is not None and not replica.acquire(f"learn:{learn.id}"):
                    continue
                self.active[learn.id] = learn
                if learn.id not in self.driven:
                    self.driven.append(learn.id)
                self._load(learn)

    def finished(self) -> bool:
        """Every learn asked for has ended (a learn asked for by name and already ended too)."""
        return not self.active

    def _load(self, learn: Learn) -> None:
        rounds = self.learns.rounds(learn.id)
        rs = next(r for r in rounds if r.round == learn.round)
        self.current[learn.id] = rs
        self.history[learn.id] = History(learn, rounds, rs.round)
        for r in rounds:  # late results of a finished rollout still land on its executions
            for rid in r.rollouts.values():
                self._run(rid)
        log.info("learn loaded", extra={"learn": learn.id, "round": rs.round,
                                        "phase": rs.phase})

    def _run(self, rid: str) -> RolloutRun:
        if rid in self.ctl.runs or self.ctl.take(rid):
            return self.ctl.runs[rid]
        # Another replica still holds its lease (it took the rollout before this one took
        # the learn): follow it from the db until the lease is ours.
        return load_run(self.store, rid)

    def work_dir(self, learn: Learn) -> Path:
        return learn.plan.work_dir or self.work_root / learn.id

    def round_dir(self, learn: Learn, k: int) -> Path:
        return self.work_dir(learn) / f"round-{k}"

    # --- the loop's turn ------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if now < self._next_tick:
            return
        self._next_tick = now + self.tick_s
        for learn in list(self.active.values()):
            try:
                self._step(learn, now)
            except (UpstreamError, OSError) as e:
                self._fail(learn, str(e))

    def _step(self, learn: Learn, now: float) -> None:
        rs = self.current[learn.id]
        for _ in range(len(TRANSITIONS)):  # several phases may end in one turn
            if rs.phase == "done":  # resumed after its last round's deploy failed
                self.learns.set_state(learn, "finished")
                self._ended(learn, now)
                return
            event = getattr(self, f"_{rs.phase}")(learn, rs, now)
            if event is None:
                return
            was, rs.phase = rs.phase, TRANSITIONS[(rs.phase, event)]  # type: ignore[assignment]
            log.info("learn phase", extra={"learn": learn.id, "round": rs.round, "from": was,
                                           "event": event, "to": rs.phase})
            if rs.phase == "done":
                self._end_round(learn, rs, now)
                return
            self.learns.save_round(learn.id, rs)

    def _end_round(self, learn: Learn, rs: RoundState, now: float) -> None:
        rs.finished_at = now
        if rs.outcome is None:
            rs.outcome = "published"
        plan = learn.plan
        nxt = None
        if rs.round < plan.rounds:
            nxt = RoundState(round=rs.round + 1, base=rs.release or rs.base, started_at=now)
        state, reason = ("running" if nxt else "finished"), None
        if rs.deploy_state == "aborted":
            state = "failed"
            reason = (f"round {rs.round}: {rs.reason}; {rs.release} stays published and is the "
                      "base of the next round: `fleetctl learn resume` goes on")
        self.learns.end_round(learn, rs, nxt, state, reason)
        log.info("learn round", extra={"learn": learn.id, "round": rs.round,
                                       "outcome": rs.outcome, "reason": rs.reason,
                                       "release": rs.release, "base": learn.base})
        if nxt is not None:
            self.current[learn.id] = nxt
            self.history[learn.id] = History(learn, self.learns.rounds(learn.id), nxt.round)
        if state != "running":
            self._ended(learn, now)

    def _fail(self, learn: Learn, reason: str) -> None:
        rs = self.current[learn.id]
        why = f"round {rs.round}, {rs.phase}: {reason}"
        self.learns.save_round(learn.id, rs)
        self.learns.set_state(learn, "failed", why)
        log.error("learn failed", extra={"learn": learn.id, "reason": why})
        self._ended(learn, time.time())

    def _ended(self, learn: Learn, now: float) -> None:
        """No round is left to use late uploads (finished): stop the learn's fine-tune
        rollouts still sending (no rollback: what devices committed passed their gates)."""
        for key in [k for k in self.tools if k[0] == learn.id]:
            self.tools.pop(key).stop()
        if learn.state == "finished":
            for r in self.learns.rounds(learn.id):
                rid = r.rollouts.get("finetune", "")
                if rid == learn.plan.first_updates:
                    continue  # the operator's own rollout: theirs to stop
                run = self.ctl.runs.get(rid)
                if run is not None and run.rollout.state in ("running", "paused"):
                    self.ctl.abort(run, f"learn {learn.id} finished: no round left for its "
                                        "uploads", now, rollback=False)
        self.active.pop(learn.id, None)

    # --- helpers the phases share ----------------------------------------------------------

    def _start_rollout(self, learn: Learn, rs: RoundState, phase: Phase) -> RolloutRun:
        """The round's rollout for ``phase``: created, or adopted when a restart finds it
        (created, but the round's record not yet saved)."""
        plan = learn.plan.rollout_plan(phase, rs.round, rs.base)
        found = self.store.rollout(plan.name)
        if found is not None:
            if (found.plan.job, found.plan.args) != (plan.job, plan.args):
                raise UpstreamError(f"a rollout named {plan.name} exists and is not this "
                                    f"round's {phase}: start the learn under another name")
            rid = found.id
        else:
            if self.ctl.replica is not None:
                # Lease it before it exists: no other replica's scan takes it in between.
                self.ctl.replica.acquire(plan.name)
            rid = self.store.create_rollout(plan, learn.targets).id
            if rid != plan.name:
                raise UpstreamError(f"rollout {plan.name} was created as {rid} (a rollout "
                                    f"named {plan.name}-... exists): rename the learn")
        rs.rollouts[phase] = rid
        self.learns.save_round(learn.id, rs)
        log.info("learn rollout", extra={"learn": learn.id, "round": rs.round,
                                         "phase": phase, "rollout": rid})
        return self._run(rid)

    def _adopt_finetune(self, learn: Learn, rs: RoundState, name: str) -> None:
        """Round 1's uploads come from a fine-tune rollout the operator already ran."""
        found = self.store.rollout(name)
        if found is None or found.plan.job != "finetune" or not (
                found.plan.args.get("steps") or {}).get("upload"):
            raise UpstreamError(f"first_updates: {name} is not a fine-tune rollout of this db "
                                "whose args upload (steps.upload: true; fleetctl rollout list)")
        rs.rollouts["finetune"] = found.id
        self.learns.save_round(learn.id, rs)
        log.info("learn rollout", extra={"learn": learn.id, "round": rs.round, "adopted": True,
                                         "phase": "finetune", "rollout": found.id})

    def _tool(self, learn: Learn, rs: RoundState, name: str,
              argv: Callable[[], list[str]]) -> tuple[int, str] | None:
        """Start tool ``name`` of this round (counted, and saved, first) or poll it: its
        (exit code, output tail) once it ended, else None."""
        key = (learn.id, rs.round, name)
        run = self.tools.get(key)
        if run is None:
            rs.tool_runs[name] = rs.tool_runs.get(name, 0) + 1
            self.learns.save_round(learn.id, rs)
            self.tools[key] = ToolRun(self.hpc_train, argv(),
                                      self.round_dir(learn, rs.round) / f"{name}.log")
            log.info("learn tool", extra={"learn": learn.id, "round": rs.round, "tool": name,
                                          "argv": " ".join(self.tools[key].argv)})
            return None
        code = run.poll()
        if code is None:
            return None
        del self.tools[key]
        return code, run.tail()

    def _running(self, learn: Learn, rs: RoundState, name: str) -> bool:
        return (learn.id, rs.round, name) in self.tools

    def _aggregate_dir(self, learn: Learn, rs: RoundState) -> Path:
        return self.round_dir(learn, rs.round) / "aggregate"

    # --- the phases: each returns its event, or None while it waits ------------------------

    def _finetune(self, learn: Learn, rs: RoundState, now: float) -> str | None:
        plan = learn.plan
        if "finetune" not in rs.rollouts:
            rs.collect_until = now + plan.collect_s
            if rs.round == 1 and plan.first_updates is not None:
                self._adopt_finetune(learn, rs, plan.first_updates)
            else:
                self._start_rollout(learn, rs, "finetune")
                return None
        chosen, dropped = collect_updates(learn, rs, self.history[learn.id], self._run)
        if has_quorum(plan, chosen):
            rs.updates, rs.dropped = chosen, dropped
            return "collected"
        ended = self._run(rs.rollouts["finetune"]).rollout.state in ROLLOUT_FINAL
        reason = skip_reason(plan, chosen, rollout_ended=ended, now=now,
                             collect_until=rs.collect_until)
        if reason is not None:
            rs.outcome, rs.reason = "skipped", reason
            return "too_few"
        return None

    def _aggregate(self, learn: Learn, rs: RoundState, now: float) -> str | None:
        out = self._aggregate_dir(learn, rs)
        device_of = {u.version: u.device for u in rs.updates}
        res = None if self._running(learn, rs, "aggregate") else read_aggregate(out, device_of)
        if res is None:
            if not self._running(learn, rs, "aggregate"):
                # What a tool killed with an earlier controller left (it died with it).
                for tmp in out.parent.glob(f".tmp-{out.name}.*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            ended = self._tool(learn, rs, "aggregate", lambda: aggregate_argv(
                learn.plan, rs.base, [u.version for u in rs.updates], out,
                targets=len(learn.targets)))
            if ended is None:
                return None
            code, tail = ended
            skipped = aggregate_skip_reason(code, tail)
            if skipped is not None:
                rs.outcome, rs.reason = "skipped", skipped
                return "too_few"
            res = read_aggregate(out, device_of) if code == 0 else None
            if res is None:
                raise UpstreamError(f"hpc-train aggregate exit {code}: {tail} (log: "
                                    f"{self.round_dir(learn, rs.round) / 'aggregate.log'})")
        rs.aggregated, rs.combined, rs.skipped = True, res.combined, res.skipped
        rs.duplicates = res.duplicates
        if res.duplicates:
            log.warning("learn round has near-identical updates under several keys", extra={
                "learn": learn.id, "round": rs.round, "groups": res.duplicates})
        return "done"

    def _candidate(self, learn: Learn, rs: RoundState, now: float) -> str | None:
        plan, agg = learn.plan, self._aggregate_dir(learn, rs)
        version = plan.release_version(rs.round, candidate=True)
        ended = self._tool(learn, rs, "candidate", lambda: candidate_argv(
            plan, agg, version, self._base_checkpoint(learn, rs)))
        if ended is None:
            return None
        code, tail = ended
        verdict = self._publish_verdict(learn, rs, "candidate", code, tail, version)
        if verdict == "published":
            rs.candidate, rs.gates = version, read_gates(agg)
            return "published"
        if verdict == "refused":
            rs.gates = read_gates(agg)
            rs.outcome = "refused"
            rs.reason = refusal_reason("upstream gate", rs.gates)
            return "refused"
        raise UpstreamError(f"hpc-train publish of the candidate exit {code}: {tail}")

    def _publish_verdict(self, learn: Learn, rs: RoundState, tool: str, code: int,
                         tail: str, version: str) -> PublishVerdict:
        """``publish_verdict`` of this round's ``tool``; a version someone else published
        stops the learn (``taken``), and a publish found done after a restart is logged."""
        verdict = publish_verdict(code, tail, learn.plan.model, version,
                                  rs.tool_runs.get(tool, 0))
        if verdict == "taken":
            raise UpstreamError(f"{learn.plan.model}@{version} is in {learn.plan.registry} "
                                f"already and this learn did not publish it: "
                                f"{learn.plan.name_fix(version)}")
        if verdict == "published" and code != 0:
            log.info("learn publish found done", extra={"learn": learn.id, "round": rs.round,
                                                        "version": version})
        return verdict

    def _base_checkpoint(self, learn: Learn, rs: RoundState) -> Path | None:
        """The checkpoint the round's base was published from (the upstream gate scores it)."""
        if rs.base == learn.plan.base:
            return learn.plan.base_checkpoint
        k = self.history[learn.id].checkpoints[rs.base]
        return self.round_dir(learn, k) / "aggregate"

    def _evaluate(self, learn: Learn, rs: RoundState, now: float) -> str | None:
        if "evaluate" not in rs.rollouts:
            self._start_rollout(learn, rs, "evaluate")
            return None
        run = self._run(rs.rollouts["evaluate"])
        if run.rollout.state not in ROLLOUT_FINAL:
            return None
        assert rs.candidate is not None
        rs.evaluations, rs.not_evaluated = read_evaluations(run, rs.candidate, rs.base)
        write_device_evals(self.round_dir(learn, rs.round) / EVALS_FILE, rs.evaluations)
        return "done"

    def _publish(self, learn: Learn, rs: RoundState, now: float) -> str | None:
        plan, agg = learn.plan, self._aggregate_dir(learn, rs)
        version = plan.release_version(rs.round)
        evals = self.round_dir(learn, rs.round) / EVALS_FILE
        if not self._running(learn, rs, "publish"):  # rewritten from the round's record
            write_device_evals(evals, rs.evaluations)
        ended = self._tool(learn, rs, "publish", lambda: release_argv(plan, agg, version, evals))
        if ended is None:
            return None
        code, tail = ended
        # gates.json now holds the device gates; the upstream one was read at the candidate.
        verdict = self._publish_verdict(learn, rs, "publish", code, tail, version)
        if verdict == "published":
            rs.release, rs.gates = version, [*rs.gates, *read_gates(agg)]
            return "published"
        if verdict == "refused":
            rs.gates = [*rs.gates, *read_gates(agg)]
            rs.outcome = "refused"
            rs.reason = refusal_reason("device gates", rs.gates)
            return "refused"
        raise UpstreamError(f"hpc-train publish of the release exit {code}: {tail}")

    def _deploy(self, learn: Learn, rs: RoundState, now: float) -> str | None:
        if not learn.plan.deploy:
            return "skip"
        if "deploy" not in rs.rollouts:
            self._start_rollout(learn, rs, "deploy")
            return None
        run = self._run(rs.rollouts["deploy"])
        if run.rollout.state not in ROLLOUT_FINAL:
            return None
        rs.deploy_state = run.rollout.state
        if rs.deploy_state == "aborted":
            rs.reason = f"deploy rollout {run.rollout.id} aborted ({run.rollout.reason})"
        return "done"

