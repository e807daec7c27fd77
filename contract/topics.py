"""Every topic of the contract, with how each is published; :class:`Topics` is the only place
topic strings are built or parsed.

Topics, with ``{p}`` the prefix (default ``fleet/v1``):

==================================  =====  ========  ==========================================
topic                               QoS    retained  message
==================================  =====  ========  ==========================================
``{p}/dev/{id}/status``             1      yes       :class:`Status` (also the last will)
``{p}/dev/{id}/telemetry``          0      no        :class:`Telemetry` (with message expiry)
``{p}/dev/{id}/cmd/{type}``         1      no        :class:`Command` to one device
``{p}/group/{g}/cmd/{type}``        1      no        :class:`Command` to every device in g
``{p}/dev/{id}/res``                1      no        :class:`Result`, one or more per command
``{p}/dev/{id}/evt/{kind}``         1      no        :class:`Event`
==================================  =====  ========  ==========================================

The messages are in :mod:`contract.messages`.
"""

from __future__ import annotations

DEFAULT_PREFIX = "fleet/v1"
TELEMETRY_EXPIRY_S = 60
"""Message Expiry Interval on telemetry: a stale reading is worse than none."""


class Topics:
    """Every topic of the contract for one prefix; the only place topic strings are built."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or prefix.startswith("/") or prefix.endswith("/") or any(
            c in prefix for c in "+#\x00"
        ):
            raise ValueError(f"MQTT prefix {prefix!r}: no leading/trailing '/', no + # NUL")
        self.prefix = prefix

    def status(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/status"

    def telemetry(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/telemetry"

    def command(self, device: str, type_: str) -> str:
        return f"{self.prefix}/dev/{device}/cmd/{type_}"

    def group_command(self, group: str, type_: str) -> str:
        return f"{self.prefix}/group/{group}/cmd/{type_}"

    def result(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/res"

    def event(self, device: str, kind: str) -> str:
        return f"{self.prefix}/dev/{device}/evt/{kind}"

    # Subscription filters.
    def device_commands(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/cmd/+"

    def group_commands(self, group: str) -> str:
        return f"{self.prefix}/group/{group}/cmd/+"

    def all_status(self) -> str:
        return f"{self.prefix}/dev/+/status"

    def all_results(self) -> str:
        return f"{self.prefix}/dev/+/res"

    def all_telemetry(self) -> str:
        return f"{self.prefix}/dev/+/telemetry"

    def all_events(self) -> str:
        return f"{self.prefix}/dev/+/evt/+"

    def parse(self, topic: str) -> tuple[str, str, str | None]:
        """``(kind, device_or_group, sub)``: kind is status | telemetry | cmd | group_cmd |
        res | evt; sub is the command type or event kind. ValueError for a foreign topic."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise ValueError(f"topic {topic!r} is not under {self.prefix!r}")
        parts = topic[len(head):].split("/")
        match parts:
            case ["dev", dev, ("status" | "telemetry" | "res") as kind]:
                return kind, dev, None
            case ["dev", dev, "cmd", type_]:
                return "cmd", dev, type_
            case ["dev", dev, "evt", kind]:
                return "evt", dev, kind
            case ["group", group, "cmd", type_]:
                return "group_cmd", group, type_
        raise ValueError(f"topic {topic!r} is not part of the contract")
