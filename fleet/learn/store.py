"""Fleet learning's durable state, in the rollouts' SQLite file (tables of its own, the same
connection and transactions as ``FleetStore``): one row per learn, one per round.

A round's record (``RoundState``) is a typed model kept as JSON: its phase, the rollouts it
made, the updates it chose, what the aggregation combined and skipped, the devices'
evaluations, the gate figures, the release. It is written at every phase change and before
every action whose repetition would cost something (a tool started, a rollout created): a
controller killed at any instant restarts from here, and each phase's action is idempotent
(``fleet.learn.driver`` says how), so nothing that finished runs again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.db import Database, IntegrityError
from fleet.learn.plan import LearnPlan
from fleet.rollout.store import FleetStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS learns (
    id TEXT PRIMARY KEY,
    plan TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    round INTEGER NOT NULL,
    base TEXT NOT NULL,
    targets TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS learn_rounds (
    learn_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    state TEXT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (learn_id, round)
);
"""

LEARN_ACTIVE = ("running",)
LEARN_FINAL = ("finished", "failed")
"""``finished``: every round ran (each published a release or kept its base, with the
reason); ``failed``: a phase needs the operator (the reason says which and why;
``fleetctl learn resume`` goes on from that phase)."""

RoundPhase = Literal["finetune", "aggregate", "candidate", "evaluate", "publish", "deploy",
                     "done"]
RoundOutcome = Literal["published", "refused", "skipped"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChosenUpdate(_Record):
    version: str
    device: str
    release: str
    """The release it was fine-tuned from."""
    staleness: int
    """Releases between that one and the round's base (0: fine-tuned from the base)."""


class Dropped(_Record):
    version: str | None = None
    device: str
    reason: str


class Evaluation(_Record):
    """One device's scores of the base and the candidate: a row of the device-evals file
    ``hpc-train publish --device-evals`` reads."""

    device: str
    samples: int = Field(gt=0)
    base_accuracy: float = Field(ge=0, le=1)
    candidate_accuracy: float = Field(ge=0, le=1)
    personalized_accuracy: float | None = Field(default=None, ge=0, le=1)
    """The candidate with the device's own head/normalization (``eval_personal``); not in
    the device-evals file (the gates read the global candidate)."""

    @property
    def gain_pts(self) -> float:
        return 100.0 * (self.candidate_accuracy - self.base_accuracy)


class GateLine(_Record):
    flag: str
    passed: bool
    detail: str


class RoundState(_Record):
    round: int
    base: str
    """The release this round's devices fine-tune from and its candidate is compared with."""
    phase: RoundPhase = "finetune"
    outcome: RoundOutcome | None = None
    reason: str | None = None
    started_at: float
    collect_until: float | None = None
    """When the round aggregates with what it has (set when its fine-tune rollout starts)."""
    rollouts: dict[str, str] = Field(default_factory=dict)
    """finetune / evaluate / deploy -> rollout id."""
    updates: list[ChosenUpdate] = Field(default_factory=list)
    """The uploads handed to ``hpc-train aggregate --updates``."""
    dropped: list[Dropped] = Field(default_factory=list)
    """Uploads left out for good: a fresher one of the same device was taken, or too stale."""
    aggregated: bool = False
    """The aggregation ran to its end: ``updates`` are spent (combined or skipped by it)."""
    combined: list[str] = Field(default_factory=list)
    skipped: list[Dropped] = Field(default_factory=list)
    """Updates the aggregation refused, with its reason."""
    duplicates: list[list[str]] = Field(default_factory=list)
    """Groups of near-identical updates the aggregation flagged (one update under several
    device keys: a Sybil signal); it combined them all."""
    candidate: str | None = None
    evaluations: list[Evaluation] = Field(default_factory=list)
    not_evaluated: list[Dropped] = Field(default_factory=list)
    gates: list[GateLine] = Field(default_factory=list)
    release: str | None = None
    deploy_state: str | None = None
    tool_runs: dict[str, int] = Field(default_factory=dict)
    """How many times each upstream command was started (1 each, unless one was killed)."""
    finished_at: float | None = None


@dataclass
class Learn:
    id: str
    plan: LearnPlan
    state: str
    reason: str | None
    round: int
    """The round in progress (the last one once finished)."""
    base: str
    """The current base: the last release published, else the plan's."""
    targets: list[str]
    created_at: float
    updated_at: float
    finished_at: float | None


class LearnExists(ValueError):
    """A learn of that name is in the db already."""


class LearnStore:
    """Learns and their rounds, beside the rollouts of ``store`` (same file, same
    connection: a round's change and the rollout it starts can share a transaction)."""

    def __init__(self, store: FleetStore) -> None:
        self.store = store
        self.db = store.db
        with self.db.schema_lock():
            self.db.script(SCHEMA)

    def create(self, plan: LearnPlan, targets: list[str]) -> Learn:
        """The learn and its first round, in one transaction."""
        now = time.time()
        first = RoundState(round=1, base=plan.base, started_at=now)
        try:
            with self.store.tx() as db:
                db.execute(
                    "INSERT INTO learns (id, plan, state, round, base, targets, created_at, "
                    "updated_at) VALUES (:id, :plan, 'running', 1, :base, :targets, :now, :now)",
                    {"id": plan.name, "plan": plan.model_dump_json(), "base": plan.base,
                     "targets": json.dumps(sorted(targets)), "now": now})
                self._put_round(db, plan.name, first)
        except IntegrityError:
            raise LearnExists(f"learn {plan.name} exists in this db: `fleetctl learn status "
                              f"{plan.name}`, or start one of another name") from None
        learn = self.learn(plan.name)
        assert learn is not None
        return learn

    def learn(self, lid: str) -> Learn | None:
        row = self.db.execute(
            "SELECT id, plan, state, reason, round, base, targets, created_at, updated_at, "
            "finished_at FROM learns WHERE id = :id", {"id": lid}).fetchone()
        if row is None:
            return None
        return Learn(row[0], LearnPlan.model_validate_json(row[1]), row[2], row[3], row[4],
                     row[5], json.loads(row[6]), *row[7:])

    def learns(self, states: tuple[str, ...] | None = None) -> list[Learn]:
        ids = [r[0] for r in self.db.execute("SELECT id FROM learns ORDER BY created_at")]
        out = [x for x in (self.learn(i) for i in ids) if x is not None]
        return [x for x in out if states is None or x.state in states]

    def rounds(self, lid: str) -> list[RoundState]:
        rows = self.db.execute(
            "SELECT state FROM learn_rounds WHERE learn_id = :id ORDER BY round", {"id": lid})
        return [RoundState.model_validate_json(r[0]) for r in rows]

    def round(self, lid: str, k: int) -> RoundState | None:
        row = self.db.execute("SELECT state FROM learn_rounds WHERE learn_id = :id AND "
                              "round = :k", {"id": lid, "k": k}).fetchone()
        return None if row is None else RoundState.model_validate_json(row[0])

    def save_round(self, lid: str, rs: RoundState) -> None:
        with self.store.tx() as db:
            self._put_round(db, lid, rs)

    def _put_round(self, db: Database, lid: str, rs: RoundState) -> None:
        db.execute("INSERT INTO learn_rounds (learn_id, round, state, updated_at) "
                   "VALUES (:id, :k, :state, :now) ON CONFLICT (learn_id, round) DO UPDATE "
                   "SET state = excluded.state, updated_at = excluded.updated_at",
                   {"id": lid, "k": rs.round, "state": rs.model_dump_json(), "now": time.time()})

    def end_round(self, learn: Learn, done: RoundState, nxt: RoundState | None,
                  state: str = "running", reason: str | None = None) -> None:
        """The round ``done``, the next one (None after the last) and the learn's new base and
        state, in one transaction: a restart sees either the old round or both."""
        now = time.time()
        final = now if state in LEARN_FINAL else None
        base = done.release or done.base
        with self.store.tx() as db:
            self._put_round(db, learn.id, done)
            if nxt is not None:
                self._put_round(db, learn.id, nxt)
            db.execute(
                "UPDATE learns SET state = :state, reason = :reason, round = :round, "
                "base = :base, updated_at = :now, finished_at = :final WHERE id = :id",
                {"state": state, "reason": reason, "round": nxt.round if nxt else done.round,
                 "base": base, "now": now, "final": final, "id": learn.id})
        learn.state, learn.reason, learn.base = state, reason, base
        learn.round = nxt.round if nxt else done.round
        learn.finished_at = final

    def set_state(self, learn: Learn, state: str, reason: str | None = None) -> None:
        now = time.time()
        final = now if state in LEARN_FINAL else None
        self.db.execute("UPDATE learns SET state = :state, reason = :reason, updated_at = :now, "
                        "finished_at = :final WHERE id = :id",
                        {"state": state, "reason": reason, "now": now, "final": final,
                         "id": learn.id})
        learn.state, learn.reason, learn.finished_at = state, reason, final
