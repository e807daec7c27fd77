"""The operator's requests to a rollout (pause, resume, abort, rollback, approve): checked
against the rollout's state and posted in the store for the controller to apply. One path for
every front end: ``fleetctl rollout pause|resume|abort|rollback|approve`` and the dashboard's
buttons both call :func:`request`, so a button can do nothing the command line would refuse.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fleet.rollout.store import ROLLOUT_FINAL, ROLLOUT_GOING, FleetStore

TAKES_REQUESTS = ROLLOUT_GOING
"""The states whose controller acts on pause, resume, abort and approve."""
VERBS = ("pause", "resume", "abort", "rollback", "approve")


class Refused(ValueError):
    """The rollout cannot take the request now (the message says why); nothing was posted."""


class UnknownRollout(Refused):
    """No rollout of that id in the db."""


def utc(ts: float | None) -> str:
    return "?" if ts is None else \
        datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def request(store: FleetStore, rid: str, verb: str, wave: int | None = None) -> dict[str, Any]:
    """Post ``verb`` for rollout ``rid`` (``wave``: approve every wave up to it); returns
    what was posted, as ``fleetctl`` prints it. Raises :class:`Refused` with the reason."""
    if verb not in VERBS:
        raise Refused(f"{verb!r}: one of {', '.join(VERBS)}")
    r = store.rollout(rid)
    if r is None:
        raise UnknownRollout(f"no rollout {rid!r} in {store.name}")
    if verb == "approve":
        return _approve(store, rid, wave)
    if verb == "rollback":
        if store.reopen_for_rollback(rid):
            return {"rollout": rid, "state": "rolling_back", "next":
                    "fleetctl controller (or the running one) sends the rollbacks"}
        store.post_request(rid, verb)
    elif not store.post_request(rid, verb, TAKES_REQUESTS):
        # Finished (or winding down): no controller would act on it; say so, post nothing.
        r = store.rollout(rid)
        assert r is not None
        if r.state in ROLLOUT_FINAL:
            raise Refused(f"rollout {rid} is already finished ({r.state} at "
                          f"{utc(r.finished_at)}): nothing to {verb}")
        why = f" ({r.reason})" if r.reason else ""
        raise Refused(f"rollout {rid} is {r.state}{why}: nothing to {verb}")
    return {"rollout": rid, "request": verb}


def _approve(store: FleetStore, rid: str, wave: int | None) -> dict[str, Any]:
    """Let the next wave (or every wave up to ``wave``) of an ``--approve-waves`` rollout
    start: posted for the controller, which records it before the wave starts."""
    r = store.rollout(rid)
    assert r is not None
    waves = store.waves(rid)
    if not r.plan.approve_waves:
        raise Refused(f"rollout {rid} was not created with --approve-waves: its waves "
                      "start on their own")
    if r.state not in TAKES_REQUESTS:
        when = f" at {utc(r.finished_at)}" if r.state in ROLLOUT_FINAL else ""
        raise Refused(f"rollout {rid} is {r.state}{when}: nothing to approve")
    if wave is None:
        nxt = next((w.idx for w in waves if w.state == "pending"), None)
        if r.state != "waiting_approval" or nxt is None:
            raise Refused(f"rollout {rid} is {r.state}, not waiting for an approval; "
                          "--wave N approves a later wave ahead")
        wave = nxt
    elif not 1 <= wave < len(waves):
        raise Refused(f"--wave {wave}: rollout {rid} has waves 0-{len(waves) - 1}, "
                      "and wave 0 needs no approval")
    if not store.post_request(rid, f"approve:{wave}", TAKES_REQUESTS):
        raise Refused(f"rollout {rid} is no longer running: nothing to approve")
    return {"rollout": rid, "request": "approve", "wave": wave}
