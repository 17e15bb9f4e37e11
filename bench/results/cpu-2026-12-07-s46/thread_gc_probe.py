"""pytest plugin (session 46): torch's intra-op thread count at each test's set-up and the time spent in Python's
garbage collector, printed in the terminal summary. Use: ``PYTHONPATH=<clone>:<this folder> pytest -p
thread_gc_probe``."""

import gc
import time

import torch

_gc = {"start": 0.0, "total": 0.0, "n2": 0, "n": 0}
_not_two: list[tuple[str, int]] = []


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["start"] = time.perf_counter()
        return
    _gc["total"] += time.perf_counter() - _gc["start"]
    _gc["n"] += 1
    _gc["n2"] += info.get("generation") == 2


gc.callbacks.append(_on_gc)


def pytest_runtest_setup(item) -> None:
    n = torch.get_num_threads()
    if n != 2:
        _not_two.append((item.nodeid, n))


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(
        f"GCPROBE gc total {_gc['total']:.1f} s in {_gc['n']} collections ({_gc['n2']} gen2); "
        f"objects {len(gc.get_objects())}; threads != 2 at {len(_not_two)} tests: {_not_two[:5]}"
    )
    with open("/proc/self/statm") as f:
        terminalreporter.write_line(f"GCPROBE rss MiB {int(f.read().split()[1]) * 4096 // 2**20}")
