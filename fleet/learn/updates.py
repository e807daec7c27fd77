"""Which device updates a round combines, and which it refuses.

A device's upload is input from outside: each fine-tune's result is parsed here (its
JobOutcome's ``uploaded``) and checked against what the round asked for; anything else is
left out with the reason (a ``Dropped``), never passed on to ``hpc-train``. The device id is
the one the topic proved (the controller's execution), never a payload's. The rules:

- ``refuse_upload``: an upload whose version is no valid name, or that is not a fine-tune of
  the model and release the round's command named, is refused.
- ``choose_updates``: per device, its freshest upload not spent by an earlier round; uploads
  fine-tuned more than ``max_staleness`` releases back, and a device's older uploads, are
  dropped for good.

``collect_updates`` applies both to a round's fine-tune rollout and the earlier rounds' (late
uploads count, FedBuff); whether the round has enough of them is ``fleet.learn.quorum``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from contract import JobOutcome, UploadInfo
from fleet.learn.store import ChosenUpdate, Dropped, Learn, RoundState
from fleet.rollout.run import RolloutRun
from registry.names import check_version


@dataclass(frozen=True)
class Upload:
    version: str
    device: str
    release: str
    """The release the fine-tune started from (the round's base, which the command named)."""
    finished_at: float


def refuse_upload(device: str, up: UploadInfo, model: str, release: str) -> Dropped | None:
    """Why ``device``'s upload ``up`` is refused: its version is no valid version name, or it
    is not a fine-tune of ``model@release`` (another model, or another parent than the
    release the round's command named). None: it may be combined."""
    try:
        check_version(up.version)
    except ValueError as err:
        return Dropped(device=device, reason=f"upload: {err}")
    if up.name != model or up.parent != release:
        return Dropped(version=up.version, device=device, reason=(
            f"uploaded {up.name}@{up.version} with parent {up.parent}; the round asked "
            f"for a fine-tune of {model}@{release}"))
    return None


def read_uploads(run: RolloutRun, model: str,
                 release: str) -> tuple[list[Upload], list[Dropped]]:
    """Every version a fine-tune of ``run`` uploaded (any attempt), and those refused."""
    out: list[Upload] = []
    bad: list[Dropped] = []
    for e in run.execs.values():
        if e.kind != "job" or e.status != "SUCCEEDED" or not e.result:
            continue
        try:
            up = JobOutcome.model_validate(e.result).uploaded
        except ValidationError:
            continue
        if up is None:
            continue  # its own gates rolled it back, or it did not upload
        refused = refuse_upload(e.device, up, model, release)
        if refused is not None:
            bad.append(refused)
            continue
        out.append(Upload(up.version, e.device, release, e.finished_at or 0.0))
    return out, bad


def choose_updates(found: list[Upload], chain: list[str], spent: set[str],
                   max_staleness: int) -> tuple[list[ChosenUpdate], list[Dropped]]:
    """The updates a round on ``chain[-1]`` combines: per device its freshest upload not yet
    spent, fine-tuned from one of the last ``max_staleness + 1`` releases of ``chain``
    (oldest first). Also what is dropped for good: a device's older uploads, and uploads
    from releases too far back (they only grow staler)."""
    newest = len(chain) - 1
    by_device: dict[str, list[tuple[int, Upload]]] = {}
    dropped: list[Dropped] = []
    for u in found:
        if u.version in spent:
            continue
        staleness = newest - chain.index(u.release) if u.release in chain else None
        if staleness is None or staleness > max_staleness:
            dropped.append(Dropped(version=u.version, device=u.device, reason=(
                f"fine-tuned from {u.release}, more than max_staleness {max_staleness} "
                f"releases before {chain[-1]}")))
            continue
        by_device.setdefault(u.device, []).append((staleness, u))
    chosen: list[ChosenUpdate] = []
    for device in sorted(by_device):
        ranked = sorted(by_device[device], key=lambda su: (su[0], -su[1].finished_at))
        staleness, best = ranked[0]
        chosen.append(ChosenUpdate(version=best.version, device=device, release=best.release,
                                   staleness=staleness))
        dropped += [Dropped(version=u.version, device=device,
                            reason=f"the same device's fresher upload {best.version} is used")
                    for _, u in ranked[1:]]
    return chosen, dropped


class History:
    """What earlier rounds of a learn leave the current one (they no longer change): the
    chain of releases, the uploads spent, the fine-tune rollouts still to read uploads from."""

    def __init__(self, learn: Learn, rounds: list[RoundState], current: int) -> None:
        earlier = [r for r in rounds if r.round < current]
        self.chain = [learn.plan.base] + [r.release for r in earlier if r.release]
        self.spent: set[str] = set()
        for r in earlier:
            if r.aggregated:
                self.spent |= {u.version for u in r.updates}
            self.spent |= {d.version for d in r.dropped if d.version}
        self.finetunes = [(r.rollouts["finetune"], r.base) for r in earlier
                          if "finetune" in r.rollouts]
        self.checkpoints = {r.release: r.round for r in earlier if r.release}
        """release -> the round whose aggregate folder it was published from."""


def collect_updates(
    learn: Learn, rs: RoundState, hist: History, run_of: Callable[[str], RolloutRun],
) -> tuple[list[ChosenUpdate], list[Dropped]]:
    """What round ``rs`` would combine now, and what it would drop for good, from the
    uploads of its own fine-tune rollout and of the earlier rounds' (``run_of``: rollout id
    -> the rollout, from the controller or the store)."""
    found, bad = [], []
    for rid, release in [*hist.finetunes, (rs.rollouts["finetune"], rs.base)]:
        ups, wrong = read_uploads(run_of(rid), learn.plan.model, release)
        found += ups
        bad += [d for d in wrong if d.version not in hist.spent]
    chosen, dropped = choose_updates(found, hist.chain, hist.spent, learn.plan.max_staleness)
    return chosen, dropped + bad
