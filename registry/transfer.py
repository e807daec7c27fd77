"""Network behaviour of every registry request: timeouts, deadlines, retries, rate cap.

The one home for retrying: :func:`with_retries` runs a request (with a total deadline over all
its attempts) and backs off with full jitter between attempts. Three limits bound a request,
because a per-read timeout alone does not stop a server that drips one byte per second
(TUF's slow-retrieval attack):

* ``read_timeout_s``: the longest silence on the socket;
* ``min_rate_bytes_per_s`` over ``min_rate_window_s``: a request that moves less is dropped
  and retried (a slow mirror may recover on a fresh connection);
* ``request_deadline_s``: the total wall time of a request and its retries; past it the
  request fails for good, whatever the server does.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from registry.errors import (
    DeadlineExceededError,
    FetchFailedError,
    SlowTransferError,
    StoreTransientError,
)

T = TypeVar("T")


class TransferConfig(BaseModel):
    """Network behaviour of pulls, uploads and publishes."""

    model_config = ConfigDict(extra="forbid")

    connect_timeout_s: float = Field(default=10.0, gt=0)
    """TCP (+TLS) connect timeout per attempt."""
    read_timeout_s: float = Field(default=30.0, gt=0)
    """Longest silence tolerated while waiting for response bytes."""
    request_deadline_s: float = Field(default=900.0, gt=0)
    """Total time one request (a manifest, a chunk) may take over all its attempts."""
    min_rate_bytes_per_s: int = Field(default=1024, ge=0)
    """A response body slower than this over a whole window is dropped and retried (0 = off)."""
    min_rate_window_s: float = Field(default=30.0, gt=0)
    """Window over which the minimum rate is measured."""
    retries: int = Field(default=8, ge=0)
    """Consecutive failed attempts per request without progress before giving up
    (an attempt that moved bytes resets the count)."""
    backoff_base_s: float = Field(default=0.5, ge=0)
    """First back-off ceiling; doubles per failed attempt (full jitter: uniform in [0, ceiling])."""
    backoff_max_s: float = Field(default=30.0, ge=0)
    """Largest back-off ceiling, and the cap on a server's Retry-After."""
    max_bytes_per_s: int | None = Field(default=None, ge=1024)
    """Bandwidth cap for all connections together (null = no cap)."""
    connections: int = Field(default=4, ge=1, le=32)
    """Parallel chunk transfers; hides round-trip latency on slow links."""
    free_disk_margin_bytes: int = Field(default=64 << 20, ge=0)
    """Space that must stay free after the chunks and the new slot are written."""
    allow_custom_models: bool = False
    """Accept model specs naming a Python factory ('pkg.mod:fn') to import on the device."""
    allow_downgrade: bool = False
    """Install a version whose signed sequence is below the highest installed (logged)."""

    @model_validator(mode="after")
    def _rates(self) -> TransferConfig:
        cap = self.max_bytes_per_s
        if cap is not None and self.min_rate_bytes_per_s * self.connections > cap:
            raise ValueError(
                f"min_rate_bytes_per_s={self.min_rate_bytes_per_s} on {self.connections} "
                f"connections exceeds max_bytes_per_s={cap}: every transfer would be dropped "
                "as too slow; lower min_rate_bytes_per_s or raise the cap"
            )
        return self


class Deadline:
    """The end of a request's time budget, on the monotonic clock."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def error(self, cause: BaseException | str = "") -> DeadlineExceededError:
        return DeadlineExceededError(
            f"{self.what}: no complete answer within its {self.seconds:g} s deadline"
            + (f" (last: {cause})" if str(cause) else "")
        )

    def timeout(self, read_timeout_s: float) -> float:
        """A socket timeout that never outlives the deadline; raises once it has passed."""
        left = self.remaining()
        if left <= 0:
            raise self.error()
        return min(read_timeout_s, left)


class RateWatch:
    """Counts bytes of one response; too few in a whole window raises SlowTransferError.

    A read must not block past the end of a window that still lacks bytes, or one read could
    wait for the whole body (http.client fills its buffer before it returns): the reader asks
    :meth:`wait_s` how long the next read may block, and calls :meth:`check` when it timed out.
    """

    def __init__(self, cfg: TransferConfig, what: str) -> None:
        self.min_rate, self.window_s, self.what = (
            cfg.min_rate_bytes_per_s, cfg.min_rate_window_s, what
        )
        self._start = time.monotonic()
        self._bytes = 0

    def moved(self, nbytes: int) -> None:
        self._bytes += nbytes
        self.check()

    def check(self) -> None:
        """Raise SlowTransferError if a whole window passed with too few bytes; start the next
        window if it passed with enough."""
        if not self.min_rate:
            return
        elapsed = time.monotonic() - self._start
        if elapsed < self.window_s:
            return
        if self._bytes < self.min_rate * elapsed:
            raise SlowTransferError(
                f"{self.what}: {self._bytes} bytes in {elapsed:.1f} s, under the minimum "
                f"{self.min_rate} B/s"
            )
        self._start, self._bytes = time.monotonic(), 0

    def wait_s(self, read_timeout_s: float) -> float:
        """How long the next read may block: the read timeout, cut to the rest of the window
        while the window still lacks bytes."""
        self.check()
        if not self.min_rate or self._bytes >= self.min_rate * self.window_s:
            return read_timeout_s
        left = self.window_s - (time.monotonic() - self._start)
        return min(read_timeout_s, max(left, 0.0) + 0.01)


def backoff_delay(attempt: int, cfg: TransferConfig, retry_after_s: float | None = None) -> float:
    """Full-jitter exponential back-off (AWS's recommendation): a fleet of devices that lost the
    same server does not come back in lock-step. A server's Retry-After is a floor."""
    ceiling = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** max(0, attempt - 1)))
    delay = random.uniform(0, ceiling)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, cfg.backoff_max_s))
    return delay


def with_retries(
    fn: Callable[[Deadline], T],
    cfg: TransferConfig,
    what: str,
    *,
    progress: Callable[[], int] | None = None,
    stop: threading.Event | None = None,
) -> T:
    """Run ``fn(deadline)``, retrying StoreTransientError with back-off, within one deadline.

    ``progress()`` (bytes kept so far) lets an attempt that moved bytes reset the count of
    failed attempts, so a resumable transfer over a flaky link keeps going while it advances.
    ``stop`` cuts the back-off short when a sibling transfer has already failed.
    """
    deadline = Deadline(cfg.request_deadline_s, what)
    attempt = 0
    while True:
        before = progress() if progress is not None else 0
        try:
            return fn(deadline)
        except StoreTransientError as e:
            if deadline.expired():
                raise deadline.error(e) from e
            moved = progress is not None and progress() > before
            attempt = 0 if moved else attempt + 1
            if attempt > cfg.retries:
                raise FetchFailedError(
                    f"{what}: gave up after {attempt} attempts without progress: {e}"
                ) from e
            delay = min(backoff_delay(attempt, cfg, e.retry_after_s), deadline.remaining())
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            if deadline.expired():
                raise deadline.error(e) from e


class RateLimiter:
    """A token bucket shared by every connection; allows a 100 ms burst."""

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = float(bytes_per_s)
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now - 0.1) + nbytes / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)
