"""What counts as this machine's own address: the one check every listener and client of the
project makes before it serves without authentication or sends a token over plain HTTP."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (all of 127.0.0.0/8, ``::1``, bracketed or not). Any
    other name is not: it may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
