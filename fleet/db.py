"""The controller's database connection: SQLite (one file, the embedded default) or PostgreSQL
(``postgresql://...``, what controller replicas share), through SQLAlchemy Core.

Why SQLAlchemy Core and not a driver directly: one SQL text with named parameters runs on both
engines (the stores' queries are plain SQL both accept, ``INSERT ... ON CONFLICT`` included),
the URL, pooling and driver quirks are its job, and the project already depends on it for the
MLflow and Optuna stores. No ORM: the stores map rows to their dataclasses themselves.

Transactions are explicit (``Database.tx``): the connection runs in autocommit, and ``tx``
sends ``BEGIN IMMEDIATE`` on SQLite (take the write lock up front, so two writers never
deadlock on a lock upgrade) or ``BEGIN`` on PostgreSQL, then ``COMMIT`` or ``ROLLBACK``.
Statements outside ``tx`` commit one by one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection, CursorResult
    from sqlalchemy.exc import IntegrityError
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("fleetctl needs SQLAlchemy: pip install 'edgetrain[fleet]'") from e

__all__ = ["Database", "IntegrityError", "is_url", "redact"]

Params = Mapping[str, Any]
_SCHEMA_LOCK = 0x6564676574  # PostgreSQL advisory lock key of schema changes ("edget")


def is_url(db: str | Path) -> bool:
    """``--db`` is a database URL (PostgreSQL), not a SQLite file path."""
    return str(db).startswith(("postgresql://", "postgresql+psycopg2://"))


def redact(db: str | Path) -> str:
    """``db`` for logs and reports: a URL's password replaced by ``***``."""
    if not is_url(db):
        return str(db)
    return sa.engine.make_url(str(db)).render_as_string(hide_password=True)


def _pyformat(sql: str) -> str:
    """``:name`` -> ``%(name)s`` (psycopg2's style; a literal % doubled)."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql.replace("%", "%%"))


class Database:
    """One connection (one per process, like the controller): ``execute``, ``executemany``,
    ``tx``. ``db``: a SQLite file path or a ``postgresql://`` URL."""

    def __init__(self, db: str | Path) -> None:
        self.name = redact(db)
        if is_url(db):
            url = "postgresql+psycopg2://" + str(db).split("://", 1)[1]
            self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
            self.dialect = "postgresql"
        else:
            path = Path(db)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.engine = sa.create_engine(
                f"sqlite:///{path}", poolclass=sa.pool.NullPool,
                connect_args={"timeout": 30, "check_same_thread": False})
            self.dialect = "sqlite"
        self.conn: Connection = self.engine.connect().execution_options(
            isolation_level="AUTOCOMMIT")
        if self.dialect == "sqlite":
            # WAL: readers (fleetctl rollout status) never block the controller's writes.
            # synchronous=NORMAL: see fleet.rollout.store on why a lost last transaction is safe.
            for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=30000"):
                self.conn.exec_driver_sql(f"PRAGMA {pragma}")
        self._depth = 0

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()

    def execute(self, sql: str, params: Params | None = None) -> CursorResult[Any]:
        return self.conn.execute(sa.text(sql), dict(params or {}))

    def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        """One statement over many rows, on the driver's own batch path: the controller
        saves every execution a turn changed in one of these, and the generic path costs
        ~100 us a row where the driver's costs a few."""
        if not rows:
            return
        raw = self.conn.connection.dbapi_connection
        assert raw is not None
        cur = raw.cursor()
        try:
            if self.dialect == "sqlite":
                cur.executemany(sql, rows)  # sqlite3 binds :name itself
            else:
                from psycopg2.extras import execute_batch

                execute_batch(cur, _pyformat(sql), rows, page_size=500)
        finally:
            cur.close()

    def fetch_raw(self, sql: str, params: Params | None = None) -> list[tuple[Any, ...]]:
        """All rows as the driver's own tuples, past SQLAlchemy's result layer (~1 us a row
        instead of ~5): for a reader that polls thousands of rows and keeps what it built
        from each (the dashboard's executions)."""
        raw = self.conn.connection.dbapi_connection
        assert raw is not None
        cur = raw.cursor()
        try:
            cur.execute(sql if self.dialect == "sqlite" else _pyformat(sql), dict(params or {}))
            return cur.fetchall()  # tuples already, from both drivers
        finally:
            cur.close()

    def script(self, ddl: str) -> None:
        """Statements separated by ``;`` (the stores' ``CREATE ... IF NOT EXISTS``)."""
        for stmt in ddl.split(";"):
            if stmt.strip():
                self.conn.exec_driver_sql(stmt)

    @property
    def serial(self) -> str:
        """The type of an auto-numbered primary key."""
        return "INTEGER" if self.dialect == "sqlite" else "BIGSERIAL"

    def has_table(self, name: str) -> bool:
        return sa.inspect(self.conn).has_table(name)

    def legacy_version(self) -> int:
        """The schema version of a db written before ``fleet_schema`` existed: SQLite's
        ``PRAGMA user_version`` (no PostgreSQL db predates it)."""
        if self.dialect != "sqlite":
            return 0
        return int(self.conn.exec_driver_sql("PRAGMA user_version").scalar() or 0)

    @contextmanager
    def schema_lock(self) -> Iterator[None]:
        """Around creating or migrating the schema: replicas starting at once on one
        PostgreSQL db take turns (CREATE ... IF NOT EXISTS races there). SQLite: its write
        lock, in one transaction."""
        if self.dialect == "sqlite":
            with self.tx():
                yield
            return
        self.conn.exec_driver_sql(f"SELECT pg_advisory_lock({_SCHEMA_LOCK})")
        try:
            yield
        finally:
            self.conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_SCHEMA_LOCK})")

    def scalar(self, sql: str, params: Params | None = None) -> Any:
        return self.execute(sql, params).scalar()

    @contextmanager
    def tx(self) -> Iterator[Database]:
        """One transaction; nested ``tx`` blocks join the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self.conn.exec_driver_sql("BEGIN IMMEDIATE" if self.dialect == "sqlite" else "BEGIN")
        self._depth = 1
        try:
            yield self
        except BaseException:
            self._depth = 0
            self.conn.exec_driver_sql("ROLLBACK")
            raise
        self._depth = 0
        self.conn.exec_driver_sql("COMMIT")
