"""What every sensor backend offers, and how a failing one degrades: it is reported once in the
log and then returns empty readings instead of raising into the training loop."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from agent.sensors.reading import Reading

log = logging.getLogger("agent.sensors")


class SensorUnavailable(RuntimeError):
    """The backend cannot work on this machine (tool missing, no permission, no hardware)."""


class SensorBackend(Protocol):
    name: str

    def read(self) -> Reading: ...

    def close(self) -> None: ...


class ReportOnce:
    """Logs each distinct problem once per backend, so a sensor that fails every second does
    not flood the log, yet the first failure is never silent."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str, *args: object) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        log.warning("%s sensors: " + message, self.backend, *args)


def empty_reading(source: str) -> Reading:
    return Reading(timestamp_s=time.time(), source=source)
