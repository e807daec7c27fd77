"""How a refused command is described: :class:`CommandRejected` (a code, a message naming the
field, and the command's id when it could be read) and the field list of a failed
validation."""

from __future__ import annotations

from pydantic import ValidationError

from contract.messages import ErrorInfo


class CommandRejected(Exception):
    """A command that fails validation; ``command_id`` is set when the id could be read, so the
    REJECTED result can name it."""

    def __init__(self, code: str, message: str, command_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.command_id = command_id


def field_errors(e: ValidationError, root: str = "") -> str:
    """The first five fields that failed, as ``path: message``, ``;``-separated."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        path = f"{root}.{loc}" if root and loc else (root or loc or "(payload)")
        parts.append(f"{path}: {err['msg']}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def error_from_validation(e: ValidationError, root: str = "args") -> ErrorInfo:
    """BAD_ARGS for a job spec that does not validate, naming the field."""
    return ErrorInfo(code="BAD_ARGS", message=field_errors(e, root))
