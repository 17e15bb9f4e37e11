"""Keep CPython's cyclic garbage collector off a serving process's long-lived heap (vLLM's ``freeze_gc_heap``).

A built engine holds ~0.3-1M objects the collector tracks (modules, tokenizer, graph and cache bookkeeping) that
live as long as it does. Every full (generation-2) collection walks all of them: on an H100 host one
``spec_bench`` process over MT-Bench ran 28 such collections of up to 323 ms each (6.5 s in all); one that lands
during decoding stalls every request in flight (and a 0.6 s benchmark point). ``gc.freeze`` moves them to the
permanent generation, which collections skip; objects created while serving (requests, outputs) are collected
as before.

Used where one engine (or shard) lives for the process: the Serve replica (``cluster.server.build_engine``),
each TP rank (``actors.tp_worker.TPWorker.load_model``) and the benchmarks' engines (``bench.systems``,
``bench.engine_bench``, ``bench.plain_overhead``). Not in ``LLMEngine`` itself: a library user who drops an engine and
calls ``gc.collect()`` expects its memory back, and a frozen engine in reference cycles (every engine) is never
collected until ``release_frozen``.
"""

from __future__ import annotations

import atexit
import gc
import time

_unfreeze_at_exit = False  # release_frozen registered with atexit


def release_frozen() -> None:
    """Give frozen objects back to the collector (they join the oldest generation; nothing is collected now).
    Call before ``gc.collect()`` meant to free a dropped engine."""
    if gc.get_freeze_count():
        gc.unfreeze()


def freeze_long_lived() -> float:
    """Collect garbage, then freeze every surviving object (``gc.collect(); gc.freeze()``). Returns the seconds
    it took (a full collection: ~0.1-0.3 s after building an engine)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:  # the interpreter's last collections must see them (nanobind reports leaks)
        atexit.register(release_frozen)
        _unfreeze_at_exit = True
    return time.perf_counter() - t0
