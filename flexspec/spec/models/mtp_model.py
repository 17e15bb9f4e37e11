"""A target's own multi-token-prediction (MTP) module, read from the target's checkpoint.

An MTP module predicts token ``p+2`` from the target's final (normed) hidden state at ``p`` and the embedding
of token ``p+1`` (DeepSeek-V3, arXiv 2412.19437 section 2.2; Qwen3-Next / Qwen3.5):

    x = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))      [2H -> H]
    x = decoder layer(s) of the target's architecture (own KV cache)
    logits = head(final_norm(x))                                 (head: the module's own or the target's)

Two checkpoint layouts are recognised:
* ``deepseek``: ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}`` plus the block's
  ``self_attn.* / mlp.* / input_layernorm / post_attention_layernorm`` under the same prefix, L = the target's
  ``num_hidden_layers`` (config ``num_nextn_predict_layers``). The pre-norm output is fed back when chaining;
  embeddings at position 0 are zeroed (as vLLM does).
* ``qwen``: ``mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}`` and ``mtp.layers.{i}.*`` (config
  ``mtp_num_hidden_layers``). The normed output is fed back.

Only the first MTP module is used; it is chained past its trained depth (one module, applied k times). The
decoder block is the target family's (``flexspec.models.llama.LlamaDecoderLayer``: Llama / Qwen2 / Qwen3); an
MTP block of another kind (MLA, MoE, gated attention) fails to load with the tensor named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flexspec.distributed import TPGroup
from flexspec.errors import ModelLoadError
from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec.layers.embedding import ParallelLMHead
from flexspec.layers.norm import RMSNorm
from flexspec.layers.rotary import RotaryEmbedding
from flexspec.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from flexspec.models.spec import ModelSpec
from flexspec.spec.models.checkpoint import read_tensors, tensor_names

_DEEPSEEK_NAMES = {  # checkpoint suffix -> MTPModule parameter (None = ignored: same as the target's)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "final_norm.weight",
    "shared_head.head.weight": "head.weight",
    "embed_tokens.weight": None,
}
_QWEN_NAMES = {
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "fc.weight": "eh_proj.weight",
    "norm.weight": "final_norm.weight",
}
_SHARDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}  # fused parameter -> shard ids it needs


@dataclass
class MTPLayout:
    kind: str  # "deepseek" | "qwen"
    prefix: str  # checkpoint name prefix of the module, e.g. "model.layers.30." or "mtp."
    num_layers: int  # decoder layers inside the module
    own_head: bool  # the module ships its own LM head (DeepSeek shared_head.head)


def find_mtp_layout(folder: Path, num_target_layers: int, name: str | None = None) -> MTPLayout:
    """Detect the MTP tensors of a checkpoint folder (``name``: how the user named it, for the error; default
    the folder).

    Raises:
        ModelLoadError: the checkpoint has no MTP weights.
    """
    names = tensor_names(folder)
    qwen = [n for n in names if n.startswith(("mtp.", "model.mtp."))]
    if qwen:
        prefix = "model.mtp." if qwen[0].startswith("model.mtp.") else "mtp."
        idx = {int(m.group(1)) for n in qwen if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", n))}
        return MTPLayout("qwen", prefix, max(idx) + 1 if idx else 0, False)
    prefix = f"model.layers.{num_target_layers}."
    if f"{prefix}eh_proj.weight" in names:
        return MTPLayout("deepseek", prefix, 1, f"{prefix}shared_head.head.weight" in names)
    raise ModelLoadError(
        f"method 'mtp': {name or folder} has no MTP weights (no 'mtp.*' tensors as in Qwen3-Next / Qwen3.5, "
        f"no '{prefix}eh_proj.weight' as in DeepSeek-V3) in {folder}; it needs a model trained with "
        "multi-token prediction: use another method (dflash, eagle3, draft_model, ngram) for this one"
    )


class MTPModule(nn.Module):
    """One MTP module over the paged KV cache of its own decoder layer(s)."""

    def __init__(self, spec: ModelSpec, tp: TPGroup, layout: MTPLayout, max_position: int) -> None:
        super().__init__()
        H = spec.hidden_size
        self.kind = layout.kind
        self.enorm = RMSNorm(H, spec.rms_norm_eps)
        self.hnorm = RMSNorm(H, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        rotary = RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, spec.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, tp, rotary) for _ in range(layout.num_layers))
        self.final_norm = RMSNorm(H, spec.rms_norm_eps)
        self.head = ParallelLMHead(spec.vocab_size, H, tp) if layout.own_head else None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(
        self, token_embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_embeds [T, H] (token p+1), hidden [T, H] (state at p) -> (logit hidden, feedback)."""
        if self.kind == "deepseek":
            token_embeds = token_embeds.masked_fill((meta.positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, meta)
        out = x + residual if residual is not None else x
        normed = self.final_norm(out)
        return normed, (out if self.kind == "deepseek" else normed)


def load_mtp_weights(module: MTPModule, folder: Path, layout: MTPLayout) -> None:
    """Copy the module's tensors from the checkpoint through the layers' weight loaders (TP-aware).

    Raises:
        ModelLoadError: naming the unexpected, mis-shaped or missing checkpoint tensor.
    """
    source = str(folder)
    prefix = layout.prefix
    tensors = read_tensors(folder, keep=lambda n: n.startswith(prefix))
    params = dict(module.named_parameters())
    loaded: dict[str, set] = {}
    for ckpt_name, tensor in tensors.items():
        local = ckpt_name[len(prefix) :]
        name = _module_name(local, layout)
        if name is None:
            continue
        shard = None
        for frag, (fused, sid) in LlamaForCausalLM.packed_modules_mapping.items():
            if f".{frag}." in name:
                name, shard = name.replace(f".{frag}.", f".{fused}."), sid
                break
        param = params.get(name)
        if param is None:
            raise ModelLoadError(
                f"{source}: MTP tensor {ckpt_name!r} has no counterpart in a {layout.kind} MTP module"
            )
        loader = getattr(param, "weight_loader", None)
        try:
            with torch.no_grad():
                if loader is None:
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ValueError(f"shape {list(tensor.shape)}, expected {list(param.shape)}")
                    param.copy_(tensor.to(param.dtype))
                else:
                    loader(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise ModelLoadError(f"{source}: MTP tensor {ckpt_name!r}: {e}") from e
        loaded.setdefault(name, set()).add(shard)
    for name in params:
        fused = next((f for f in _SHARDS if f".{f}." in name), None)
        want = set(_SHARDS[fused]) if fused else {None}
        missing = want - loaded.get(name, set())
        if missing:
            ckpt_name = prefix + _ckpt_name(name, missing.pop(), layout)
            raise ModelLoadError(f"{source}: checkpoint is missing MTP tensor {ckpt_name!r}")


def _module_name(local: str, layout: MTPLayout) -> str | None:
    table = _DEEPSEEK_NAMES if layout.kind == "deepseek" else _QWEN_NAMES
    if local in table:
        return table[local]
    if layout.kind == "deepseek":
        return f"layers.0.{local}"
    return local  # qwen: "layers.{i}.…" as in the module


def _ckpt_name(name: str, shard: object, layout: MTPLayout) -> str:
    """Checkpoint spelling of a module parameter (for error messages)."""
    for frag, (fused, sid) in LlamaForCausalLM.packed_modules_mapping.items():
        if f".{fused}." in name and sid == shard:
            name = name.replace(f".{fused}.", f".{frag}.")
            break
    table = _DEEPSEEK_NAMES if layout.kind == "deepseek" else _QWEN_NAMES
    for ckpt, ours in table.items():
        if ours == name:
            return ckpt
    return name[len("layers.0.") :] if layout.kind == "deepseek" else name
