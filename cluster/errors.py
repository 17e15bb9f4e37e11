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
    "validation_param_and_message",
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


# pydantic names a union's branches in an error's location ("stop.str", "prompt.list[int].0"); users wrote none
_BRANCH_NAMES = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids",
    "list[list[int]]": "a list of token id lists",
    "list[TextPart]": "a list of text parts",
}


def _is_branch(x: object) -> bool:
    """Whether a location element is a union branch's name (``str``, ``list[int]``, ``TextPart``), not a field
    (the request schemas' fields are snake_case) or a list index."""
    return isinstance(x, str) and (x in _BRANCH_NAMES or "[" in x or x[:1].isupper())


def validation_param_and_message(errors: list[dict[str, Any]]) -> tuple[str | None, str]:
    """The first bad field of a pydantic error list as (param, ``"param: message"``), e.g. ``temperature`` or
    ``messages.0.role``. A value matching no branch of a union field (``stop: str | list[str]``) is named after
    the field, with the branches expected (``stop: expected a string or a list of strings``), unless exactly one
    branch got past its type check: then that branch's own error (``messages.0.content.0.text: Field
    required``)."""
    if not errors:
        return None, "invalid request"
    locs = [[x for x in err.get("loc", ()) if x not in ("body", "__root__")] for err in errors]
    loc = locs[0]
    msg = str(errors[0].get("msg", "invalid request")).removeprefix("Value error, ")
    cut = next((i for i, x in enumerate(loc) if _is_branch(x)), None)
    if cut is not None:
        field = loc[:cut]
        branches: dict[str, list[int]] = {}  # branch -> indexes of its errors
        for j, eloc in enumerate(locs):
            if eloc[:cut] == field and len(eloc) > cut and _is_branch(eloc[cut]):
                branches.setdefault(str(eloc[cut]), []).append(j)
        deeper = [n for n, js in branches.items() if all(len(locs[j]) > cut + 1 for j in js)]
        if len(deeper) == 1:  # the value has that branch's shape: its own error says what is wrong inside
            j = branches[deeper[0]][0]
            loc = field + [x for x in locs[j][cut + 1 :] if not _is_branch(x)]
            msg = str(errors[j].get("msg", "invalid value")).removeprefix("Value error, ")
        else:
            names = [_BRANCH_NAMES.get(n, n) for n in branches]
            expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
            loc, msg = field, f"expected {expected}"
    param = ".".join(str(x) for x in loc) or None
    return param, f"{param}: {msg}" if param else msg


def error_from_validation(e: ValidationError, prefix: str = "") -> tuple[int, dict[str, Any]]:
    """A pydantic error -> 400 naming the first bad field (:func:`validation_param_and_message`), e.g.
    ``temperature`` or ``messages.0.role``; ``prefix`` goes before the field."""
    param, text = validation_param_and_message(e.errors())
    if param and prefix:
        text = f"{prefix}.{text}"
        param = f"{prefix}.{param}"
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
