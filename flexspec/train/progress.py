"""Progress bars (tqdm when installed, periodic log lines otherwise) and the run's time limit."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Self

log = logging.getLogger("flexspec.train")

EXIT_TIME_LIMIT = 75  # EX_TEMPFAIL: stopped at --max-minutes; run the same command again to continue


class Deadline:
    """Wall-clock budget of one run. Stages poll ``expired`` between units of work and stop cleanly."""

    def __init__(self, minutes: float | None) -> None:
        self.start = time.monotonic()
        self.end = None if minutes is None else self.start + 60.0 * minutes
        self.hit = False

    def remaining(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def expired(self, reserve_s: float = 0.0) -> bool:
        """True once fewer than ``reserve_s`` seconds are left (sticky)."""
        if not self.hit and self.remaining() <= reserve_s:
            self.hit = True
        return self.hit


class Progress:
    """``with Progress(total, desc) as bar: bar.update(n, **postfix)``: tqdm if importable, else a log line
    every ``every_s`` seconds (so device logs stay short)."""

    def __init__(
        self, total: int | None, desc: str, initial: int = 0, unit: str = "it", every_s: float = 30.0
    ):
        self.total, self.desc, self.n, self.unit, self.every_s = total, desc, initial, unit, every_s
        self._t0 = self._last = time.monotonic()
        self._start_n = initial
        self._bar: Any = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, initial=initial, unit=unit, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s or (self.total is not None and self.n >= self.total):
            self._last = now
            rate = (self.n - self._start_n) / max(now - self._t0, 1e-9)
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            total = f"/{self.total}" if self.total is not None else ""
            log.info(
                "%s: %d%s %s (%.2f %s/s) %s", self.desc, self.n, total, self.unit, rate, self.unit, extra
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def setup_logging(folder: Path | None = None, level: int = logging.INFO) -> None:
    """Log ``flexspec.train`` to stderr and, when given, to ``folder/pipeline.log`` (appended)."""
    log.setLevel(level)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    if not any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in log.handlers
    ):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        log.addHandler(h)
    if folder is not None:
        path = str((folder / "pipeline.log").resolve())
        if not any(isinstance(h, logging.FileHandler) and h.baseFilename == path for h in log.handlers):
            for h in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
                log.removeHandler(h)
                h.close()
            folder.mkdir(parents=True, exist_ok=True)
            fh = logging.FileHandler(path)
            fh.setFormatter(fmt)
            log.addHandler(fh)
    log.propagate = False
