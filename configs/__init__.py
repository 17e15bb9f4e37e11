"""Pydantic schemas for flexspec (no torch, no ray). One schema drives the CLI, YAML and Helm values."""

from configs.engine import EngineConfig
from configs.sampling import SamplingParams

__all__ = ["EngineConfig", "SamplingParams"]
