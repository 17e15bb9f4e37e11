"""``flexspec bench [SUITE] ARGS``: forwards ARGS to a benchmark module's argparse ``main``.

SUITE is ``spec`` (default: ``bench.spec_bench``), ``engine`` (``bench.engine_bench``), ``synthetic``,
``plots`` or ``table``; ``flexspec bench [SUITE] --help`` lists that suite's options. Errors the user can fix
(an unknown model, a setting the machine cannot satisfy, a value the config schema rejects, an option that is
not JSON) are one ``error:`` line and exit code 2, both here and under ``python -m bench.SUITE``.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable

SUITES = {
    "spec": "bench.spec_bench",
    "engine": "bench.engine_bench",
    "synthetic": "bench.synthetic",
    "plots": "bench.plots",
    "table": "bench.table",
}


def run(argv: list[str]) -> None:
    suite = argv[0] if argv and argv[0] in SUITES else "spec"
    rest = argv[1:] if argv and argv[0] in SUITES else argv
    prog = f"flexspec bench {suite}" if argv and argv[0] in SUITES else "flexspec bench"
    importlib.import_module(SUITES[suite]).main(rest, prog=prog)  # usage lines name the command typed


def user_error(e: Exception) -> str | None:
    """The one-line message of an error the user can fix; None for anything else (a bug: keep its traceback)."""
    from pydantic import ValidationError

    from flexspec.errors import FlexspecError, validation_message

    if isinstance(e, FlexspecError):  # --device cuda without a GPU, an unknown --model, ...
        return e.message
    if isinstance(e, ValidationError):  # a value the engine's config schema rejects
        return validation_message(e)
    if isinstance(e, json.JSONDecodeError):  # --profile / --speculative-config take JSON
        return f"an option that takes JSON is not valid JSON: {e}"
    return None


def main_entry(main: Callable[[], object]) -> None:
    """``python -m bench.SUITE``: run ``main``; an error the user can fix is printed as ``flexspec bench``
    prints it (one ``error:`` line on stderr, exit code 2) instead of a traceback."""
    try:
        main()
    except Exception as e:
        message = user_error(e)
        if message is None:
            raise
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2) from None
