# GC pauses of a benchmark process: every collection's duration by generation, and those that ran inside
# LLMEngine.step (a stall of the requests in flight). NO_FREEZE=1 turns flexspec.engine.gc_heap's freeze off.
import atexit, collections, gc, json, os, sys, time

_ev = collections.defaultdict(list)
_in_step = collections.defaultdict(list)
_t = {}
_depth = [0]


def _cb(phase, info):
    if phase == "start":
        _t["t"] = time.perf_counter()
    elif "t" in _t:
        ms = (time.perf_counter() - _t["t"]) * 1000
        _ev[info["generation"]].append(ms)
        if _depth[0]:
            _in_step[info["generation"]].append(ms)


gc.callbacks.append(_cb)
import flexspec.engine.gc_heap as _g  # noqa: E402
import flexspec.engine.llm_engine as _le  # noqa: E402

if os.environ.get("NO_FREEZE"):
    _g.freeze_long_lived = lambda: 0.0
_step = _le.LLMEngine.step


def _wrapped(self):
    _depth[0] += 1
    try:
        return _step(self)
    finally:
        _depth[0] -= 1


_le.LLMEngine.step = _wrapped


def _summary(ev):
    return {str(g): {"n": len(v), "max_ms": round(max(v), 3), "sum_ms": round(sum(v), 2),
                     "n_over_1ms": sum(x > 1 for x in v)} for g, v in sorted(ev.items())}


@atexit.register
def _dump():
    out = {"all": _summary(_ev), "inside_engine_steps": _summary(_in_step)}
    p = os.environ.get("GC_OUT")
    if p:
        with open(p, "w") as f:
            json.dump(out, f)
    print("GC", out, file=sys.stderr)
