"""The Optuna study storage that ``hpc-train tune`` workers share: ``make_storage`` opens an
RDB storage (SQLite or PostgreSQL) so that many workers opening a fresh one at the same moment
do not trip over each other's first writes (a lock around the first open, bounded retries with
jitter for what the lock cannot cover).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import time
import warnings
from collections.abc import Iterator
from typing import Any

# Not imported: optuna and sqlalchemy until a storage is opened.

log = logging.getLogger("hpc_core.tune")  # one logger for every part of `hpc-train tune`


# Workers started together (a Slurm array, a Kubernetes Job) all open a fresh study's database
# at once, and Optuna's first open is several separate writes: the tables, the version row, the
# alembic stamp. Each one's loser gets "table ... already exists", an IntegrityError on a
# duplicate row or, on SQLite, "database is locked". So first opens are serialised (a flock
# beside a SQLite file, an advisory lock on PostgreSQL) and retried with a bounded back-off for
# what the lock cannot cover (a shared disk without flock, another engine, a server starting).
STORAGE_ATTEMPTS = 8
_PG_INIT_LOCK_KEY = 0x65646774  # any constant, the same in every worker


def make_storage(
    url: str, *, attempts: int = STORAGE_ATTEMPTS, heartbeat_s: int | None = None
) -> Any:
    """An Optuna RDB storage at ``url``; safe when many workers open a fresh one at once.
    ``heartbeat_s``: running trials record a heartbeat this often (see
    ``hpc_core.tune.trial._heartbeat``)."""
    import optuna
    from sqlalchemy import exc

    # SQLite serialises writers: wait for the lock instead of failing when workers collide.
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url.startswith("postgresql://"):
        # SQLAlchemy 2.1 defaults to psycopg 3; the tracking extra ships psycopg2.
        url = "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    for attempt in range(1, attempts + 1):
        try:
            with _first_open_lock(url), warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_s
                )
        except (exc.IntegrityError, exc.OperationalError, exc.ProgrammingError) as e:
            if attempt == attempts or (
                isinstance(e, exc.ProgrammingError) and "already exists" not in str(e)
            ):
                raise
            # Jitter: workers that collided once must not wake up together again.
            delay = min(2.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning(
                "opening the study storage failed (attempt %d of %d), retrying in %.2f s: %s",
                attempt, attempts, delay, str(e).splitlines()[0],
            )  # fmt: skip
            time.sleep(delay)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _first_open_lock(url: str) -> Iterator[None]:
    """Hold the lock that serialises opening the storage: a flock on ``DB.lock`` beside a
    SQLite file, a session advisory lock on PostgreSQL, none elsewhere. A dead holder's lock
    goes with its process or connection, so a killed worker never blocks the others."""
    import sqlalchemy

    parsed = sqlalchemy.engine.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        # NullPool: closing the connection ends the server session, and the lock with it.
        engine = sqlalchemy.create_engine(parsed, poolclass=sqlalchemy.pool.NullPool)
        try:
            with engine.connect() as conn:
                conn.execute(
                    sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _PG_INIT_LOCK_KEY}
                )
                yield
        finally:
            engine.dispose()
        return
    fd = None
    if backend == "sqlite" and parsed.database and parsed.database != ":memory:":
        try:
            fd = os.open(f"{parsed.database}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            # No such folder (SQLite will say so), read-only, or no flock on this file
            # system: go on unlocked, the retries still cover.
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock
