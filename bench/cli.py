"""``flexspec bench [SUITE] ARGS``: forwards ARGS to a benchmark module's argparse ``main``.

SUITE is ``spec`` (default: ``bench.spec_bench``), ``engine`` (``bench.engine_bench``), ``synthetic``,
``plots`` or ``table``; ``flexspec bench [SUITE] --help`` lists that suite's options.
"""

from __future__ import annotations

import importlib

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
