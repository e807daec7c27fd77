"""The one loopback check every listener and client uses (registry.credentials)."""

from __future__ import annotations

import pytest

from registry.credentials import is_loopback


@pytest.mark.parametrize(("host", "ok"), [
    ("localhost", True), ("127.0.0.1", True), ("127.0.0.2", True), ("127.255.255.254", True),
    ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("[::]", False), ("10.0.0.1", False),
    ("192.168.1.10", False), ("fe80::1", False), ("example.com", False),
    ("localhost.example.com", False), ("", False),
])
def test_what_counts_as_loopback(host: str, ok: bool) -> None:
    assert is_loopback(host) is ok
