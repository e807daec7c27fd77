"""``python -m fleet.cli``: ``fleetctl`` where its entry point is not installed."""

from __future__ import annotations

from fleet.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
