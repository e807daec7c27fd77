"""``fleetctl dashboard``: the operator's live web page over the fleet.

- ``fleet.dashboard.snapshot``: what the page shows of the state db (rollouts, waves, failures,
  learns and their accuracy per round), read on its own connection, cheaply;
- ``fleet.dashboard.devices``: the device table from retained status and telemetry over MQTT,
  and its bounded views (counts, attention first, filter, pages);
- ``fleet.dashboard.live``: the hub that refreshes both and the server-sent event streams
  (a snapshot, then diffs; a cap on live pages; heartbeats);
- ``fleet.dashboard.auth``: the operator token, sessions, CSRF and origin checks of a write;
- ``fleet.dashboard.app``: the Starlette application (routes, template, security headers);
  ``templates/`` and ``static/`` its page and script;
- ``fleet.dashboard.server``: all of it on the bounded HTTP server (``registry.http_server``).

A layer of ``fleet`` between ``fleet.cli`` (which starts it) and ``fleet.learn`` (it reads
learns and rollouts; writes go through ``fleet.rollout.operator``, as the command line's).
"""
