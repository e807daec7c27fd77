"""Waiting in tests: poll a condition until it holds or its deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(pred: Callable[[], T], timeout_s: float, what: str | Callable[[], str], *,
          poll_s: float = 0.05) -> T:
    """Call ``pred`` every ``poll_s`` until it returns something truthy and return that;
    after ``timeout_s`` raise AssertionError naming ``what`` was awaited (a callable: its
    answer then, e.g. the state of the processes that should have got there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {said}")
        time.sleep(poll_s)
