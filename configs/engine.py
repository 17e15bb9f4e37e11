"""Engine configuration: which model, how much memory, how to batch."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from configs.speculative import SpeculativeConfig


class EngineConfig(BaseModel):
    """Settings of one engine instance (one replica; all TP ranks share it)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(
        "smollm2-135m-instruct",
        description="Model id from the built-in registry, an HF checkpoint folder (safetensors), or a .gguf file.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer path if not next to the weights.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on GPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    max_model_len: int = Field(2048, gt=0, description="Max prompt + output tokens per sequence.")
    max_num_seqs: int = Field(64, gt=0, le=1024, description="Max sequences in one batch.")
    max_num_batched_tokens: int = Field(
        2048, gt=0, description="Token budget per engine step (prefill chunks + decode tokens)."
    )
    kv_block_size: int = Field(16, gt=0, description="Tokens per KV-cache block (paged attention).")
    num_kv_blocks: int | None = Field(None, gt=0, description="Override the number of KV blocks.")
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0, description="Fraction of GPU memory to use.")
    cpu_kv_cache_gib: float = Field(1.0, gt=0.0, description="KV-cache size on CPU, GiB.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks.")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs.")
    async_output_processing: bool = Field(
        True,
        description="Overlap a step's output processing (detokenization, request outputs) with the next step "
        "(vLLM's async output processing). One process (TP = 1): plain steps are launched without waiting "
        "(also a drafter's plain steps when it keeps no per-step state or updates it on the device, e.g. DFlash); "
        "speculative steps run synchronously.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="Schedule and launch the next plain decode step before the current one's sampled tokens "
        "reach the host (vLLM's async scheduling), so the device does not wait for the host's scheduling, input "
        "building and graph launch: the next step's input ids are the current step's sampled ids, gathered on "
        "the device. A request that stops on EOS, a stop token or a stop string computes one token more, which "
        "is dropped (outputs are unchanged). Needs async_output_processing and one process (TP = 1); with a "
        "speculative_config only plain steps after plain steps (the policy decided plain); steps that prefill, "
        "return logprobs or start speculation are scheduled after the previous step's tokens as before. None = on for CUDA / ROCm devices (on a CPU steps run synchronously and gain "
        "nothing).",
    )
    cuda_graph_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 48, 64],
        description="Decode batch sizes captured as CUDA graphs.",
    )
    cuda_graph_num_tokens: list[PositiveInt] = Field(
        default_factory=lambda: [32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536],
        description="Token counts captured as CUDA graphs for steps that prefill (prompts, chunked prefill, "
        "prefill mixed with decode): a step replays the smallest count that holds its tokens (padding at most "
        "1.5x); max_num_batched_tokens is always added. [] = such steps run eagerly.",
    )
    seed: int = Field(0, description="Global seed for requests without their own.")
    trust_remote_code: bool = Field(
        False,
        description="Let transformers run a checkpoint's own tokenizer code (auto_map). Model weights always "
        "run flexspec's model classes; checkpoint model code is never imported.",
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over several steps.")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding (vLLM --speculative-config fields); None = plain decoding."
    )
    speculation_profile_steps: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Warm-up profile of the per-batch execution policy (execution 'auto'): decode steps timed "
        "per execution mode and batch-size bucket at engine start, on dummy requests; 0 = none (the policy "
        "measures online only). None = 8 on GPU, 0 on CPU.",
    )

    @field_validator("speculative_config")
    @classmethod
    def _check_draft_tp(cls, spec, info: ValidationInfo):
        """The drafter runs unsharded or at the target's TP (an error named at ``speculative_config``)."""
        tp = info.data.get("tensor_parallel_size", 1)  # declared above: validated first
        if spec is not None and spec.draft_tensor_parallel_size not in (None, 1, tp):
            raise ValueError(
                f"draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size ({tp}), "
                f"got {spec.draft_tensor_parallel_size}"
            )
        return spec

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        return self
