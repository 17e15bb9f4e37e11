import gc, time, torch, os
_t = {"start": 0.0, "total": 0.0, "n2": 0, "n": 0}
def _cb(phase, info):
    if phase == "start":
        _t["start"] = time.perf_counter()
    else:
        _t["total"] += time.perf_counter() - _t["start"]; _t["n"] += 1
        if info.get("generation") == 2: _t["n2"] += 1
gc.callbacks.append(_cb)
_threads = []
def pytest_runtest_setup(item):
    n = torch.get_num_threads()
    if n != 2: _threads.append((item.nodeid, n))
def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"GCPROBE gc total {_t['total']:.1f} s in {_t['n']} collections ({_t['n2']} gen2); objects {len(gc.get_objects())}; threads!=2 at {len(_threads)} tests: {_threads[:5]}")
    with open('/proc/self/statm') as f: terminalreporter.write_line(f"GCPROBE rss MiB {int(f.read().split()[1])*4096//2**20}")
