"""Registry tests share the registry fixtures (loopback server, keys, publisher)."""

from tests.support.registry_fixtures import (  # noqa: F401
    fast_transfers,
    make_keypair,
    new_model,
    publisher,
    registry_server,
    upstream_key,
)
