"""Typed errors users can act on; the HTTP layer maps each to an OpenAI-shaped error and status code. Also
the request check and the one-line messages that the server and the command line share."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pydantic import ValidationError


class FlexspecError(Exception):
    """Base class. ``status`` is the HTTP status, ``code`` the OpenAI error code, ``param`` the field."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(FlexspecError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


def check_context_length(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_param: str = "prompt"
) -> None:
    """Reject a request whose prompt + ``max_tokens`` does not fit in ``max_model_len`` (OpenAI's 400), rather
    than cutting its output short with finish reason ``length``; the server and ``flexspec generate`` share it.

    Raises:
        ContextLengthExceededError: ``param`` is ``prompt_param`` when the prompt alone leaves no room for one
            output token, else ``max_tokens``.
    """
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for output.",
            param=prompt_param,
        )
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            "completion).",
            param="max_tokens",
        )


def check_prompt_min_tokens(
    min_num_tokens: int, num_chars: int, max_model_len: int, prompt_param: str = "prompt"
) -> None:
    """Reject, before tokenizing, a prompt text of ``num_chars`` characters that has at least ``min_num_tokens``
    tokens (a sound lower bound: ``flexspec.engine.prompt_bound``) when that alone fills ``max_model_len``: the
    error :func:`check_context_length` gives a prompt that leaves no room for output, so no prompt that would
    fit is ever rejected here.

    Raises:
        ContextLengthExceededError: ``param`` = ``prompt_param``.
    """
    if min_num_tokens >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has at least "
            f"{min_num_tokens} tokens ({num_chars} characters), which leaves no room for output.",
            param=prompt_param,
        )


class ConfigError(FlexspecError, ValueError):
    """An engine setting that this machine or model cannot satisfy, found while building the engine (e.g.
    ``device='cuda'`` without a GPU, ``max_model_len`` past the model's limit); ``param`` names the field."""

    status = 500
    type = "invalid_config"


class ModelNotFoundError(FlexspecError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ModelLoadError(FlexspecError):
    """Weights or config could not be loaded (missing, corrupt, unsafe format, wrong shapes)."""

    status = 500
    type = "model_load_error"


class EngineDeadError(FlexspecError):
    """The replica's engine loop stopped (a TP rank died or a step failed); Serve restarts the replica."""

    status = 503
    type = "engine_unavailable"


class EngineStepError(FlexspecError):
    """A step failed with this request in its batch, for a reason other than a lost TP rank or a device fault (e.g.
    an exception in sampling; in-process executor only): the engine loop stopped and Serve restarts the replica,
    but the request is not retried on another one, since it may be what made the step fail (a retry could stop
    the next replica too)."""

    status = 500
    type = "server_error"


class WorkerGroupError(FlexspecError):
    """A TP rank died, failed, or did not answer in time; the replica must be restarted."""

    status = 503
    type = "engine_unavailable"


def validation_message(e: ValidationError, prefix: str = "", options: Mapping[str, str] | None = None) -> str:
    """A pydantic error as one line: ``field.path: message; ...`` (the command line's ``error:`` text).

    ``prefix`` goes before every path (where the model was read from: ``applications.0.args``); ``options``
    renames a path's first field to the command-line option that set it (``{"max_tokens": "--max-tokens"}``),
    so ``flexspec generate --max-tokens 0`` says ``--max-tokens: ...``, as ``flexspec serve`` names its options
    (such a path gets no ``prefix``: the option overrides the file's field).
    The speculative config's method, which pydantic's tagged union puts into the path
    (``speculative_config.ngram.num_speculative_tokens``), is left out: users write no such field. A check of
    the whole model (no path) gives its message alone (it names its fields), without pydantic's
    ``Value error,`` prefix."""
    tags = _speculative_methods()
    methods = ", ".join(sorted(tags))
    parts = []
    for err in e.errors():
        loc = [str(x) for x in err["loc"]]
        loc = [
            x for i, x in enumerate(loc) if not (x in tags and (i == 0 or loc[i - 1] == "speculative_config"))
        ]
        named = options is not None and bool(loc) and loc[0] in options
        if named:  # an option the user typed: no file path before it
            loc[0] = options[loc[0]]
        path = ".".join([prefix] * bool(prefix and not named) + loc)
        msg = err["msg"].removeprefix("Value error, ")
        # pydantic's own texts: "Unable to extract tag using discriminator 'method'", "Input tag 'x' found using
        # 'method' does not match any of the expected tags: ..."
        if err["type"] == "union_tag_not_found":
            msg = f"missing 'method' (one of: {methods})"
        elif err["type"] == "union_tag_invalid":
            msg = f"unknown method {err.get('ctx', {}).get('tag', '?')!r} (one of: {methods})"
        parts.append(f"{path}: {msg}" if path else msg)
    return "; ".join(parts)


@functools.cache
def _speculative_methods() -> frozenset[str]:
    """The ``method`` tags of the speculative config's variants (``configs.speculative.SpeculativeConfig``)."""
    from typing import get_args

    from configs.speculative import SpeculativeConfig

    union = get_args(SpeculativeConfig)[0]
    return frozenset(get_args(cls.model_fields["method"].annotation)[0] for cls in get_args(union))
