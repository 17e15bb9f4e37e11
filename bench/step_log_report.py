"""Summarize ``bench.spec_bench --step-log`` output: where each system's step time goes, by mode and switch.

    python -m bench.step_log_report bench/results/.../steps.tgz [--output report.json]

The step log holds one JSON line per engine step (``{system}_{dataset}_b{batch}.jsonl``, rounds of ``--repeats``
appended with their ``round``). Each step is classed by its mode and the mode of the step before it (in the same
round): ``steady`` (same mode), ``enter`` (plain decoding -> a speculative mode: drafts without verifying),
``exit`` (speculative -> plain: verifies the last drafts without drafting), ``switch`` (between two speculative
modes) or ``start`` (a round's first step); steps that also prefilled a prompt are ``prefill`` whatever their mode.
Per (batch-size bucket as the policy's: 1, 2, 4, ... sequences; mode; class): steps, wall and executor (launch +
wait for the device) ms as mean and p50, the host share (wall - executor, mean), the share launched ahead of the
previous step's output processing, the share of the file's total wall time, and why the policy chose the mode
(``reasons``: steps per ``Decision.reason``, where the log records it). The policy times the same classes
(``SpeculationPolicy.observe``); this is the offline view, e.g. of what ``auto`` pays for its switches (session
30's H100 logs, b=64: entering speculation cost up to 4.5 steady speculative steps before that session's cheaper
entry, 0.9-1.3 after it).

Input: a folder of ``.jsonl`` step logs or a tar archive of one (``.tgz`` / ``.tar.gz`` / ``.tar.xz``, as stored
under ``bench/results``). Output: one block per file through the bench logger (stderr, as the other bench tools);
``--output`` writes the JSON (``schema`` flexspec.bench.step_log_report/1).
"""

from __future__ import annotations

import argparse
import json
import math
import tarfile
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import JsonReport, environment, log, median, output_path
from flexspec.spec.step_times import batch_bucket

SCHEMA = "flexspec.bench.step_log_report/1"


def step_class(previous: str | None, mode: str, decode: bool) -> str:
    """The class of a step of ``mode`` after a step of ``previous`` (None: the round's first step)."""
    if not decode:
        return "prefill"
    if previous is None:
        return "start"
    if previous == mode:
        return "steady"
    if previous == "plain":
        return "enter"
    return "exit" if mode == "plain" else "switch"


def _text(name: str, data: bytes) -> list[str]:
    try:
        return data.decode().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not UTF-8 text") from None


def _read_logs(source: Path) -> Iterator[tuple[str, list[str]]]:
    """(file name, lines) of every ``.jsonl`` step log in a folder or a tar archive, sorted by name. Raises
    ValueError for anything else, a damaged archive or a file that is not UTF-8 text."""
    if source.is_dir():
        for path in sorted(p for p in source.rglob("*.jsonl") if p.is_file()):
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ValueError(f"{path}: cannot read ({e})") from None
            yield path.name, _text(path.name, data)
        return
    try:
        if not tarfile.is_tarfile(source):
            raise ValueError(f"{source}: neither a folder of step logs nor a tar archive of one")
        with tarfile.open(source) as tar:
            members = sorted(
                (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jsonl")),
                key=lambda m: m.name,
            )
            for m in members:
                f = tar.extractfile(m)
                if f is not None:
                    yield Path(m.name).name, _text(m.name, f.read())
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:  # truncated or damaged
        raise ValueError(f"{source}: damaged archive ({type(e).__name__}: {e})") from None


def _record(name: str, i: int, line: str) -> tuple[dict[str, Any], str, float, float, bool, int]:
    """(record, mode, wall ms, executor ms, decode, bucket) of one step line. Raises ValueError otherwise."""
    try:
        rec = json.loads(line)
        mode, decode = rec["mode"], rec["decode"]
        wall, exe = float(rec["wall_ms"]), float(rec["exec_ms"])
        bucket = batch_bucket(int(rec["num_seqs"]))
        ok = isinstance(mode, str) and isinstance(decode, bool) and math.isfinite(wall + exe)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError, RecursionError):
        ok = False
    if not ok:
        raise ValueError(f"{name} line {i}: not a spec_bench step record")
    return rec, mode, wall, exe, decode, bucket


def summarize(name: str, lines: list[str]) -> dict[str, Any]:
    """One step log's summary (see the module doc). Raises ValueError for a line that is not a step record."""
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = defaultdict(list)
    previous: str | None = None
    current_round = None
    total = 0.0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec, mode, wall, exe, decode, bucket = _record(name, i, line)
        if rec.get("round") != current_round:
            current_round, previous = rec.get("round"), None
        key = (bucket, mode, step_class(previous, mode, decode))
        groups[key].append({**rec, "wall_ms": wall, "exec_ms": exe})
        previous = mode
        total += wall
    rows = []
    for (bucket, mode, cls), steps in sorted(groups.items()):
        wall = [s["wall_ms"] for s in steps]
        exe = [s["exec_ms"] for s in steps]
        rows.append(
            {
                "bucket": bucket,
                "mode": mode,
                "class": cls,
                "steps": len(steps),
                "wall_ms_mean": round(sum(wall) / len(wall), 4),
                "wall_ms_p50": round(median(wall), 4),
                "exec_ms_mean": round(sum(exe) / len(exe), 4),
                "exec_ms_p50": round(median(exe), 4),
                "host_ms_mean": round((sum(wall) - sum(exe)) / len(wall), 4),
                "ahead_share": round(sum(bool(s.get("ahead")) for s in steps) / len(steps), 4),
                "time_share": round(sum(wall) / total, 4) if total else 0.0,
                "reasons": dict(sorted(Counter(s["reason"] for s in steps if s.get("reason")).items())),
            }
        )
    return {
        "file": name,
        "steps": sum(r["steps"] for r in rows),
        "wall_ms_total": round(total, 3),
        "rows": rows,
    }


def build_parser(prog: str = "python -m bench.step_log_report") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="folder of spec_bench --step-log files, or a tar archive of one")
    p.add_argument("--output", type=output_path, default=None, help="write the summary as JSON here")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bench.step_log_report") -> dict[str, Any]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    source = Path(args.source)
    if not source.exists():
        parser.error(f"{source}: no such file or folder")
    try:
        files = [summarize(name, lines) for name, lines in _read_logs(source)]
    except ValueError as e:
        parser.error(str(e))
    if not files:
        parser.error(f"{source}: no .jsonl step logs in it")
    doc = {"schema": SCHEMA, "env": environment(), "config": vars(args), "files": files}
    if args.output:
        JsonReport(args.output, doc).save()
    for f in files:
        log(f"{f['file']}: {f['steps']} steps, {f['wall_ms_total']:.1f} ms")
        for r in f["rows"]:
            log(
                f"  b<={r['bucket']:<3d} {r['mode']:>10s} {r['class']:>7s} {r['steps']:6d} steps  "
                f"wall {r['wall_ms_mean']:7.3f} "
                f"(p50 {r['wall_ms_p50']:.3f})  exec {r['exec_ms_mean']:7.3f}  host {r['host_ms_mean']:6.3f}  "
                f"ahead {r['ahead_share']:.2f}  time {100 * r['time_share']:5.1f}%"
                + ("  " + " ".join(f"{k} {v}" for k, v in r["reasons"].items()) if r["reasons"] else "")
            )
    return doc


if __name__ == "__main__":
    main_entry(main)
