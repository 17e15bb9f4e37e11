"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from flexspec.errors import EngineDeadError, FlexspecError, WorkerGroupError

# EngineDeadError / WorkerGroupError live in flexspec.errors; re-exported here for older imports.
__all__ = [
    "EngineDeadError",
    "OverloadedError",
    "RequestTooLargeError",
    "WorkerGroupError",
    "error_body",
    "error_from_exception",
    "error_from_validation",
    "to_wire",
]


class RequestTooLargeError(FlexspecError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class OverloadedError(FlexspecError):
    """Every replica's queue is full; retry after ``retry_after_s``."""

    status = 503
    type = "server_overloaded"

    def __init__(self, message: str, status: int = 503, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        if status == 429:
            self.type = "rate_limit_exceeded"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_from_exception(e: FlexspecError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) of a typed flexspec error."""
    return e.status, error_body(e.message, e.type, e.param, e.code)


def error_from_validation(e: ValidationError, prefix: str = "") -> tuple[int, dict[str, Any]]:
    """A pydantic error -> 400 naming the first bad field, e.g. ``temperature`` or ``messages.0.role``."""
    err = e.errors()[0]
    param = ".".join(str(x) for x in err.get("loc", ()) if x != "__root__") or None
    if param and prefix:
        param = f"{prefix}.{param}"
    msg = err.get("msg", "invalid request")
    text = f"{param}: {msg}" if param else msg
    return 400, error_body(text, "invalid_request_error", param, None)


def to_wire(e: BaseException) -> dict[str, Any]:
    """An exception as the plain dict that crosses the replica -> ingress boundary (no pickled classes)."""
    if isinstance(e, FlexspecError):
        status, body = error_from_exception(e)
    elif isinstance(e, ValidationError):
        status, body = error_from_validation(e)
    else:
        status, body = 500, error_body(f"internal error: {type(e).__name__}: {e}", "internal_error")
    return {"status": status, **body}
