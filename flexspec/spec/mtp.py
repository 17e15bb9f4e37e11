"""MTP drafter: the target's own multi-token-prediction module, method ``mtp``.

Reads the target's final hidden state (the output of its last layer, through the target's final norm) of every
committed position and chains the checkpoint's first MTP module autoregressively for ``k`` steps — past its
trained depth when ``k`` exceeds it (see :mod:`flexspec.spec.models.mtp_model` for the layouts and
:mod:`flexspec.spec.models.feature_chain` for the drafting loop and KV cache). A target without MTP weights
fails at load with a ModelLoadError saying so. Drafts are greedy.
"""

from __future__ import annotations

import torch

from flexspec.distributed import TPGroup
from flexspec.errors import ModelLoadError
from flexspec.models.loader import resolve_model_dir
from flexspec.spec.models.draft_kv import DraftKVCache
from flexspec.spec.models.feature_chain import FeatureChainDrafter
from flexspec.spec.models.mtp_model import MTPModule, find_mtp_layout, load_mtp_weights
from flexspec.spec.registry import register

_LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@register
class MTPDrafter(FeatureChainDrafter):
    method = "mtp"

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        self.target = runner.model
        self.device = runner.device
        spec = runner.spec
        folder = resolve_model_dir(config.model) if config.model else runner.model_dir
        name = f"model {config.model!r}" if config.model else f"the target model {runner.config.model!r}"
        if spec.architecture not in _LLAMA_FAMILY:  # before the weights: no MTP module would run on it anyway
            raise ModelLoadError(
                f"method 'mtp': MTP modules are supported for {', '.join(_LLAMA_FAMILY)} targets, not "
                f"{spec.architecture} (the target model {runner.config.model!r})"
            )
        layout = find_mtp_layout(folder, spec.num_layers, name)
        if layout.num_layers < 1:
            raise ModelLoadError(
                f"{folder}: the MTP module has no decoder layer ('{layout.prefix}layers.0.*')"
            )
        tp = runner.tp if config.draft_tensor_parallel_size != 1 else TPGroup()
        max_tokens = runner.config.max_model_len + self.num_speculative_tokens
        self.net = MTPModule(spec, tp, layout, max_position=max_tokens)
        load_mtp_weights(self.net, folder, layout)
        self.net.to(device=runner.device, dtype=runner.dtype).eval().requires_grad_(False)
        for layer in self.net.layers:  # RoPE tables stay fp32 whatever the weight dtype
            rot = layer.self_attn.rotary
            rot.cos, rot.sin = rot.cos.float(), rot.sin.float()
        attn = self.net.attention_layers()[0]
        self.cache = DraftKVCache(
            num_layers=layout.num_layers,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            block_size=runner.config.kv_block_size,
            max_tokens_per_seq=max_tokens,
            max_num_seqs=runner.config.max_num_seqs,
            dtype=runner.dtype,
            device=runner.device,
        )
        self._last_layer = spec.num_layers - 1

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self._last_layer,)

    def attention_layers(self) -> list:
        return self.net.attention_layers()

    def features(self, captured: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        return self.target.norm(captured[0].index_select(0, rows))  # the target's final hidden state

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.net.head is not None:
            return self.net.head(hidden).float()
        return self.target.compute_logits(hidden)
