"""Executors run one step's ``ModelInput`` on every TP rank and return rank 0's ``ModelOutput``.

The engine only sees this interface, so it never imports Ray: ``LocalExecutor`` runs in-process (TP=1);
the Ray executor in ``actors/`` drives one worker actor per rank.
"""

from __future__ import annotations

from typing import Protocol

from flexspec.engine.model_input import ModelInput, ModelOutput


class Executor(Protocol):
    num_kv_blocks: int
    model_dir: str
    device_type: str  # of the ranks' devices: "cuda" (also ROCm) | "cpu"

    def execute(self, inp: ModelInput) -> ModelOutput: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """TP=1 in the calling process."""

    def __init__(self, config) -> None:
        from flexspec.engine.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.allocate_kv_cache()
        self.model_dir = str(self.runner.model_dir)
        self.spec = self.runner.spec
        self.device_type = self.runner.device.type

    def execute(self, inp: ModelInput) -> ModelOutput:
        out = self.runner.execute(inp)
        assert out is not None  # rank 0 always answers
        return out

    def can_launch(self, inp: ModelInput) -> bool:
        """Whether ``inp`` can be launched and collected separately: a plain step (no drafter, or one whose
        worker allows it: no drafts to verify or propose, no per-step drafter state) or a device-side
        verification step (``SpecDecodeWorker.can_launch``)."""
        worker = self.runner.spec_worker
        return worker is None or worker.can_run_plain(inp) or worker.can_launch(inp)

    def launch(self, inp: ModelInput):
        """Start a step (``can_launch``); ``collect`` its output before the next ``launch``."""
        return self.runner.launch(inp)

    def collect(self, pending) -> ModelOutput:
        return self.runner.collect(pending)

    def shutdown(self) -> None:
        pass
