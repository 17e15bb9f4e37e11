"""Per-batch speculation decision, made once by the engine and sent to every TP rank inside ModelInput.

Ranks that disagreed on whether to draft would deadlock in collectives (a known vLLM hang), so no rank ever
decides on its own. This base policy implements vLLM's ``disable_by_batch_size``; the cost-model policy for
FlexDraft's parallel / decoupled modes extends it.
"""

from __future__ import annotations

from configs.engine import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput


class SpeculationPolicy:
    def __init__(self, config: EngineConfig) -> None:
        assert config.speculative_config is not None
        self.spec = config.speculative_config

    def num_speculative_tokens(self, sched: SchedulerOutput) -> int:
        """Drafts to propose for the next step of this batch (0 = plain decoding)."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(sched.scheduled) > limit:
            return 0
        return self.spec.num_speculative_tokens
