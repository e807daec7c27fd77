"""When the daemon answers a command DEFERRED instead of queueing it (Greengrass'
``DeferComponentUpdate``): a ``deploy`` from the fleet while a fine-tune runs on this device, or
while the running job's governor throttles (the board is hot or over its power budget). The
device keeps no record of a deferred command; the fleet sends the same id again after the
``recheck_after_s`` of the answer (``limits.defer_recheck_s``), and a later delivery that
finds the device idle is queued as any other.

Only commands that came over MQTT are deferred: the fleet controller knows to send them
again, while a person at the control socket asked for that job now (it queues, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.daemon.device import governor_of

DEFERRED_TYPES = frozenset({"deploy"})
"""Job types a busy device puts off: an install would compete with the fine-tune for the
model slots, memory and the thermal budget."""
BUSY_STATES = frozenset({"THROTTLED", "PAUSED"})
"""Governor states in which the device is throttling (``agent.pacing``)."""


def defer_reason(cmd_type: str, source: str, job: dict[str, Any] | None,
                 job_type: Callable[[str], str | None]) -> str | None:
    """Why a ``cmd_type`` command from ``source`` is put off now, or None to queue it.
    ``job``: the running job's progress (``JobRunner.progress``), ``job_type``: the type of a
    stored job by id."""
    if cmd_type not in DEFERRED_TYPES or source != "mqtt" or job is None:
        return None
    gov = governor_of(job)
    if gov is not None and gov.state in BUSY_STATES:
        why = f" ({gov.reason})" if gov.reason else ""
        return f"the device is throttling: governor {gov.state}{why}"
    if job_type(str(job.get("id"))) == "finetune":
        return f"a finetune job is running ({job.get('id')})"
    return None
