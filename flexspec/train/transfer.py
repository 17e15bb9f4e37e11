"""Move a run folder through size-capped transfers (the H200 device returns at most 8 files of 16 MiB, 64 MiB
in all, from ``$OUT``; files are carried back in at most 64 MiB).

``export`` writes to a flat folder: ``summary.json`` (status, validation, last log rows, what the bundle
holds), ``train_log.jsonl``, ``loss_curve.png`` and ``bundle.tar.gz.part-NN``: ``final/`` (the packaged
drafter), run metadata, ``data/`` (target responses) and the latest checkpoint. When that exceeds the budget,
the bundle gives up, in order: the optimizer moments (resume restarts them), fp32 checkpoint weights (bf16
copies kept), the checkpoint, the data; ``summary.json`` says what was given up. ``import`` restores a bundle
into an empty run folder (``cat parts | tar -xz`` does the same)."""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from flexspec.train.checkpoint import latest_checkpoint

PART_BYTES = 15 * 2**20
MAX_FILES = 8
TOTAL_BYTES = 62 * 2**20
SMALL_FILES = ("train_log.jsonl", "loss_curve.png")


def _member(root: Path, path: Path) -> tuple[str, bytes | Path]:
    return str(path.relative_to(root)), path


def _bf16_member(root: Path, path: Path) -> tuple[str, bytes | Path]:
    """A safetensors file cast to bf16 (half the bytes; resuming from it upcasts to fp32)."""
    import torch
    from safetensors.torch import load_file, save

    tensors = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_file(str(path)).items()
    }
    return str(path.relative_to(root)), save(tensors)


def _files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            out.append(p)
    return out


Members = list[tuple[str, "bytes | Path"]]  # (name in the tar, file or content)


def _bundle_levels(root: Path) -> list[tuple[str, Callable[[], Members]]]:
    """(what was given up, members) from the full bundle down to the bare minimum (members built lazily)."""
    meta = [
        root / n
        for n in ("config.json", "commands.jsonl", "status.json", "validation.json", "train_log.jsonl")
    ]
    base = [_member(root, p) for p in _files([root / "final", *meta])]
    data = [_member(root, p) for p in _files([root / "data"])]
    ckpt = latest_checkpoint(root)
    state: list[tuple[str, bytes | Path]] = []
    weights: list[Path] = []
    optimizer: list[tuple[str, bytes | Path]] = []
    if ckpt is not None:
        state = [_member(root, p) for p in _files([ckpt / "state.json", ckpt / "rng.safetensors"])]
        weights = _files([ckpt / "drafter"])
        optimizer = [_member(root, p) for p in _files([ckpt / "optimizer.pt"])]
    fp32 = [_member(root, p) for p in weights]

    def bf16() -> list[tuple[str, bytes | Path]]:
        return [_bf16_member(root, p) if p.suffix == ".safetensors" else _member(root, p) for p in weights]

    return [
        ("", lambda: base + data + state + fp32 + optimizer),
        ("optimizer", lambda: base + data + state + fp32),
        ("optimizer, fp32 checkpoint weights (bf16 kept)", lambda: base + data + state + bf16()),
        ("optimizer, checkpoint", lambda: base + data),
        ("optimizer, checkpoint, data", lambda: base),
    ]


def _tar_gz(members: list[tuple[str, bytes | Path]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, src in members:
            if isinstance(src, Path):
                tar.add(src, arcname=name)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(src)
                tar.addfile(info, io.BytesIO(src))
    return buf.getvalue()


def export(root: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    small = [root / n for n in SMALL_FILES if (root / n).is_file()]
    budget = min(
        TOTAL_BYTES - sum(p.stat().st_size for p in small) - 2**20, (MAX_FILES - 1 - len(small)) * PART_BYTES
    )
    blob, dropped, members = b"", "", []
    for dropped, make in _bundle_levels(root):
        members = make()
        blob = _tar_gz(members)
        if len(blob) <= budget:
            break
    else:
        raise ValueError(f"{root}: even final/ and the run metadata exceed the {budget} byte export budget")
    for old in out.glob("bundle.tar.gz.part-*"):
        old.unlink()
    parts = [blob[i : i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)]
    for i, part in enumerate(parts):
        (out / f"bundle.tar.gz.part-{i:02d}").write_bytes(part)
    for p in small:
        (out / p.name).write_bytes(p.read_bytes())
    log_rows = (
        (root / "train_log.jsonl").read_text().splitlines()[-5:]
        if (root / "train_log.jsonl").is_file()
        else []
    )
    summary = {
        "run": str(root),
        "status": _read_json(root / "status.json"),
        "validation": _read_json(root / "validation.json"),
        "last_log_rows": [json.loads(r) for r in log_rows if r.strip()],
        "bundle": {
            "parts": len(parts),
            "bytes": len(blob),
            "files": len(members),
            "dropped": dropped or None,
        },
        "restore": "python -m flexspec.train.run_device import --from <parts dir> --output <run dir>",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def import_bundle(src: Path, root: Path) -> bool:
    """Unpack ``src/bundle.tar.gz.part-*`` into ``root`` unless it already holds a run. Returns True if
    unpacked."""
    parts = sorted(src.glob("bundle.tar.gz.part-*"))
    if not parts:
        raise FileNotFoundError(f"no bundle.tar.gz.part-* in {src}")
    if (root / "config.json").is_file():
        print(f"{root} already holds a run; not importing")
        return False
    root.mkdir(parents=True, exist_ok=True)
    blob = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.name.startswith(("/", "..")) or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                raise ValueError(f"unsafe member {m.name!r} in bundle")
        tar.extractall(root)
    return True


def _read_json(path: Path) -> object:
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexspec.train.run_device {export,import}")
    parser.add_argument("command", choices=["export", "import"])
    parser.add_argument("--output", required=True, help="Run folder.")
    parser.add_argument("--to", help="export: folder to write the files to (e.g. $OUT).")
    parser.add_argument("--from", dest="src", help="import: folder holding bundle.tar.gz.part-*.")
    args = parser.parse_args(argv)
    root = Path(args.output)
    if args.command == "export":
        if not args.to:
            parser.error("export needs --to")
        if not (root / "config.json").is_file():
            print(f"{root} holds no run; nothing to export", file=sys.stderr)
            return 1
        s = export(root, Path(args.to))
        print(json.dumps({"bundle": s["bundle"], "status": s["status"]}))
        return 0
    if not args.src:
        parser.error("import needs --from")
    import_bundle(Path(args.src), root)
    return 0
