"""Runs the stages in order on one run folder; each stage resumes where the last run stopped.

Exit codes: 0 = the requested stages are complete; 75 = stopped at ``max_minutes`` (state saved: run the same
command again); 2 = bad input (message printed).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable

from flexspec.train.config import STAGES, TrainConfig, resolve_config
from flexspec.train.data import write_json
from flexspec.train.features import run_extract
from flexspec.train.generate import run_generate
from flexspec.train.methods import get_method
from flexspec.train.methods.base import TrainMethod
from flexspec.train.package import run_package
from flexspec.train.progress import EXIT_TIME_LIMIT, Deadline, log, setup_logging
from flexspec.train.trainer import run_train
from flexspec.train.validate import run_validate

StageFn = Callable[[TrainConfig, TrainMethod, Deadline], bool]
STAGE_FNS: dict[str, StageFn] = {
    "generate": lambda cfg, method, deadline: run_generate(cfg, deadline),
    "extract": run_extract,
    "train": run_train,
    "validate": run_validate,
    "package": run_package,
}


def run(cfg: TrainConfig, argv: list[str] | None = None) -> int:
    """Run ``cfg.stage`` (or all stages) on ``cfg.output``; returns the exit code."""
    deadline = Deadline(cfg.max_minutes)
    cfg = resolve_config(cfg)
    setup_logging(cfg.dir)
    command = shlex.join(argv if argv is not None else [sys.executable, *sys.argv])
    with (cfg.dir / "commands.jsonl").open("a") as f:
        f.write(json.dumps({"time": round(time.time(), 1), "stage": cfg.stage, "command": command}) + "\n")
    method = get_method(cfg)
    status_path = cfg.dir / "status.json"
    status = json.loads(status_path.read_text()) if status_path.is_file() else {}
    for stage in STAGES if cfg.stage == "all" else (cfg.stage,):
        t0 = time.perf_counter()
        log.info("stage %s: start", stage)
        done = STAGE_FNS[stage](cfg, method, deadline)
        _release_memory()  # the next stage's engine sizes its KV cache from free device memory
        status[stage] = {
            "complete": done,
            "seconds": round(time.perf_counter() - t0, 1),
            "time": round(time.time(), 1),
        }
        write_json(status_path, status)
        if not done:
            log.info("stage %s: stopped at the time limit; run the same command again to continue", stage)
            return EXIT_TIME_LIMIT
        log.info("stage %s: done in %.1f s", stage, time.perf_counter() - t0)
    return 0


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
