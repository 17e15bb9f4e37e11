"""FlexDraft drafter weights (arXiv 2605.20022): the target's own last layers, attention-tuned for mask tokens.

From split layer ``s`` on, mask tokens use their own q/k/v/o projections (+ q/k norms when the target has
them) while sharing the target's norms and MLP (the same tensors, same TP shard). A learned mask embedding
enters at layer ``s``; mask tokens read the target's KV cache and are never written to it. Mask token j of a
block placed at positions P+1 .. P+B (context = positions <= P) predicts the token AT its own position; the
first one sits on the bonus token's position, so drafts come from masks 1 .. B-1. The bonus token is not
visible to attention (in parallel mode it is not known yet); the bonus-guided calibration
MLP([embed(bonus); h]) adds it back as a correction before the LM head (a logit bias lm_head(delta)).

Checkpoint: ``config.json`` (``architectures: ["FlexDraftModel"]``, ``flexdraft_config``: split_layer,
block_size, tuned_layer_ids, calibration_hidden_size, plus the target's shape fields) and
``model.safetensors`` with ``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``{q,k}_norm.weight``) for each
tuned layer i, ``mask_embedding`` [H], ``calibration.fc1.weight`` [C, 2H], ``calibration.fc2.weight`` [H, C].
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flexspec.errors import ModelLoadError
from flexspec.models.llama import LlamaAttention, LlamaForCausalLM
from flexspec.spec.models.checkpoint import config_field, read_config, read_tensors, save_checkpoint


@dataclass
class FlexDraftModelConfig:
    split_layer: int
    block_size: int
    calibration_hidden_size: int
    # target shape (checked at load)
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int

    @property
    def tuned_layer_ids(self) -> list[int]:
        return list(range(self.split_layer, self.num_hidden_layers))

    def to_json(self) -> dict:
        d = asdict(self)
        d["tuned_layer_ids"] = self.tuned_layer_ids
        return {"architectures": ["FlexDraftModel"], "flexdraft_config": d}

    @classmethod
    def from_json(cls, cfg: dict, source: str) -> FlexDraftModelConfig:
        if cfg.get("architectures") != ["FlexDraftModel"]:
            raise ModelLoadError(f"{source}: config.json architectures must be ['FlexDraftModel']")
        fields = {
            n: config_field(cfg, f"flexdraft_config.{n}", int, source) for n in cls.__dataclass_fields__
        }
        out = cls(**fields)
        tuned = cfg["flexdraft_config"].get("tuned_layer_ids")
        if tuned is not None and tuned != out.tuned_layer_ids:
            raise ModelLoadError(f"{source}: flexdraft_config.tuned_layer_ids must be split_layer .. L-1")
        if not 0 < out.split_layer < out.num_hidden_layers or out.block_size < 2:
            raise ModelLoadError(f"{source}: need 0 < split_layer < num_hidden_layers and block_size >= 2")
        return out


class Calibration(nn.Module):
    """Bonus-guided calibration: delta = fc2(silu(fc1([embed(bonus); h]))), added to h before the LM head."""

    def __init__(self, hidden_size: int, calibration_hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2 * hidden_size, calibration_hidden_size, bias=False)
        self.fc2 = nn.Linear(calibration_hidden_size, hidden_size, bias=False)

    def forward(self, bonus_embed: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # [..., H] x2 -> [..., H]
        return self.fc2(F.silu(self.fc1(torch.cat([bonus_embed, h], dim=-1))))


class FlexDraftModel(nn.Module):
    """Tuned attention for layers >= split_layer + mask embedding + calibration, bound to a target model.

    The target is held by reference (not a submodule): its weights are never saved with the drafter.
    """

    def __init__(self, cfg: FlexDraftModelConfig, target: LlamaForCausalLM) -> None:
        super().__init__()
        if not isinstance(target, LlamaForCausalLM):
            raise ModelLoadError(
                f"FlexDraft supports Llama-family targets (Llama/Qwen2/Qwen3), got {type(target).__name__}"
            )
        spec = target.spec
        mismatch = [
            (name, getattr(cfg, name), want)
            for name, want in (
                ("num_hidden_layers", spec.num_layers),
                ("hidden_size", spec.hidden_size),
                ("num_attention_heads", spec.num_heads),
                ("num_key_value_heads", spec.num_kv_heads),
                ("head_dim", spec.head_dim),
                ("vocab_size", spec.vocab_size),
            )
            if getattr(cfg, name) != want
        ]
        if mismatch:
            name, got, want = mismatch[0]
            raise ModelLoadError(
                f"FlexDraft checkpoint was made for another target: {name} = {got}, target has {want}"
            )
        self.cfg = cfg
        self._target = [target]  # list: keep it out of this module's parameters / state_dict
        self.layers = nn.ModuleList(
            _TunedLayer(LlamaAttention(spec, target.tp, target.layers[i].self_attn.rotary))
            for i in cfg.tuned_layer_ids
        )
        self.mask_embedding = nn.Parameter(torch.zeros(spec.hidden_size), requires_grad=False)
        self.calibration = Calibration(spec.hidden_size, cfg.calibration_hidden_size)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target[0]

    @property
    def attn(self) -> nn.ModuleList:
        """Tuned attention per tuned layer (the ``SideStream.attn`` list)."""
        return nn.ModuleList(layer.self_attn for layer in self.layers)

    # ---- construction / checkpoints -----------------------------------------------------------------------
    @classmethod
    def init_for_target(
        cls,
        target: LlamaForCausalLM,
        split_layer: int,
        block_size: int = 16,
        calibration_hidden_size: int = 1024,
    ) -> FlexDraftModel:
        """A fresh drafter: tuned projections copied from the target's layers, zero calibration output."""
        spec = target.spec
        cfg = FlexDraftModelConfig(
            split_layer=split_layer,
            block_size=block_size,
            calibration_hidden_size=calibration_hidden_size,
            num_hidden_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            vocab_size=spec.vocab_size,
        )
        if not 0 < split_layer < spec.num_layers:
            raise ValueError(f"split_layer must be in (0, {spec.num_layers}), got {split_layer}")
        model = cls(cfg, target)
        dev = target.embed_tokens.weight.device
        model.to(dev)
        with torch.no_grad():
            for layer, i in zip(model.layers, cfg.tuned_layer_ids):
                src, dst = target.layers[i].self_attn, layer.self_attn
                dst.qkv_proj.weight.copy_(src.qkv_proj.weight)
                dst.o_proj.weight.copy_(src.o_proj.weight)
                if src.q_norm is not None:
                    dst.q_norm.weight.copy_(src.q_norm.weight)
                    dst.k_norm.weight.copy_(src.k_norm.weight)
            emb = target.embed_tokens.weight
            model.mask_embedding.copy_(emb.float().mean(0).to(emb.dtype))
            nn.init.normal_(model.calibration.fc1.weight, std=1.0 / math.sqrt(2 * spec.hidden_size))
            nn.init.zeros_(model.calibration.fc2.weight)
        return model

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Tuned projections (+ q/k norms), mask embedding and calibration; the target stays frozen."""
        params = list(self.parameters())
        for p in params:
            p.requires_grad_(True)
        return params

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """State in the checkpoint's naming (q/k/v unfused). TP=1 only."""
        if self.target.tp.size != 1:
            raise ValueError("save FlexDraft checkpoints from a TP=1 model")
        out: dict[str, torch.Tensor] = {"mask_embedding": self.mask_embedding}
        for layer, i in zip(self.layers, self.cfg.tuned_layer_ids):
            a = layer.self_attn
            q, k, v = a.qkv_proj.weight.split([a.qkv_proj.q_size, a.qkv_proj.kv_size, a.qkv_proj.kv_size])
            pre = f"layers.{i}.self_attn."
            out.update({pre + "q_proj.weight": q, pre + "k_proj.weight": k, pre + "v_proj.weight": v})
            out[pre + "o_proj.weight"] = a.o_proj.weight
            if a.q_norm is not None:
                out[pre + "q_norm.weight"] = a.q_norm.weight
                out[pre + "k_norm.weight"] = a.k_norm.weight
        out["calibration.fc1.weight"] = self.calibration.fc1.weight
        out["calibration.fc2.weight"] = self.calibration.fc2.weight
        return out

    def save_pretrained(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        state = {n: t.detach().to(dtype) for n, t in self.checkpoint_state().items()}
        save_checkpoint(Path(folder), self.cfg.to_json(), state)

    @classmethod
    def from_pretrained(cls, folder: str | Path, target: LlamaForCausalLM) -> FlexDraftModel:
        """Load a checkpoint for ``target`` (TP-sharded like the target through the weight loaders).

        Raises:
            ModelLoadError: bad config field, target mismatch, missing / unexpected / mis-shaped tensor.
        """
        folder = Path(folder)
        source = str(folder)
        cfg = FlexDraftModelConfig.from_json(read_config(folder), source)
        model = cls(cfg, target)
        tensors = read_tensors(folder)
        expected = set(model.checkpoint_names())
        missing = sorted(expected - set(tensors))
        if missing:
            raise ModelLoadError(f"{source}: checkpoint is missing tensor {missing[0]!r}")
        unexpected = sorted(set(tensors) - expected)
        if unexpected:
            raise ModelLoadError(f"{source}: unexpected tensor {unexpected[0]!r} in checkpoint")
        try:
            with torch.no_grad():
                _copy(model.mask_embedding, tensors["mask_embedding"], "mask_embedding")
                _copy(
                    model.calibration.fc1.weight, tensors["calibration.fc1.weight"], "calibration.fc1.weight"
                )
                _copy(
                    model.calibration.fc2.weight, tensors["calibration.fc2.weight"], "calibration.fc2.weight"
                )
                for layer, i in zip(model.layers, cfg.tuned_layer_ids):
                    a, pre = layer.self_attn, f"layers.{i}.self_attn."
                    for sid in ("q", "k", "v"):
                        a.qkv_proj.weight_loader(
                            a.qkv_proj.weight, tensors[f"{pre}{sid}_proj.weight"].float(), sid
                        )
                    a.o_proj.weight_loader(a.o_proj.weight, tensors[pre + "o_proj.weight"].float())
                    if a.q_norm is not None:
                        _copy(a.q_norm.weight, tensors[pre + "q_norm.weight"], pre + "q_norm.weight")
                        _copy(a.k_norm.weight, tensors[pre + "k_norm.weight"], pre + "k_norm.weight")
        except ValueError as e:
            raise ModelLoadError(f"{source}: {e}") from e
        return model

    def checkpoint_names(self) -> list[str]:
        names = ["mask_embedding", "calibration.fc1.weight", "calibration.fc2.weight"]
        for layer, i in zip(self.layers, self.cfg.tuned_layer_ids):
            pre = f"layers.{i}.self_attn."
            names += [pre + f"{p}_proj.weight" for p in ("q", "k", "v", "o")]
            if layer.self_attn.q_norm is not None:
                names += [pre + "q_norm.weight", pre + "k_norm.weight"]
        return names

    # ---- inference helpers --------------------------------------------------------------------------------
    def draft_logits(self, h: torch.Tensor, bonus_ids: torch.Tensor) -> torch.Tensor:
        """h [M, H] final-norm hidden of mask tokens, bonus_ids [M] -> calibrated logits [M, V] fp32."""
        t = self.target
        delta = self.calibration(t.embed(bonus_ids).to(h.dtype), h)
        return t.compute_logits(h + delta)

    # ---- training -----------------------------------------------------------------------------------------
    def training_loss(
        self,
        target: LlamaForCausalLM,
        input_ids: torch.Tensor,  # [B, T] long: prompt + target response
        loss_mask: torch.Tensor,  # [B, T] bool: positions whose token may be a draft label (the response)
        num_anchors: int = 8,
        gamma: float = 7.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Attention-tuning loss (dense; the target is frozen, gradients reach only this module).

        For ``num_anchors`` random anchors p per sequence (p + 1 inside the response), a block of B mask tokens
        at positions p+1 .. p+B sees the target's K/V of positions <= p (per tuned layer) and its own block;
        mask j >= 1 predicts token p+1+j with cross-entropy weight exp(-(j-1)/gamma) (DFlash's position decay);
        the calibration gets embed(token p+1), the bonus.

        Returns (loss, {"acc_per_pos": [B-1] accuracy per draft position, "num_labels": count}).
        """
        B, T = input_ids.shape
        Bk = self.cfg.block_size
        dev = input_ids.device
        # Anchors: p with p + 1 a response position (the bonus) and p >= 0.
        cand = loss_mask.clone()
        cand[:, 0] = False
        weights = cand.float() + 1e-9 * (~cand).float()
        first = torch.multinomial(weights, num_anchors, replacement=True, generator=generator)  # [B, A] = p+1
        p = first - 1  # [B, A]
        j = torch.arange(Bk, device=dev)
        pos = (p.unsqueeze(-1) + 1 + j).reshape(B, -1)  # [B, M], M = A*Bk
        M = pos.shape[1]
        h = self.dense_side_hidden(target, input_ids, p)  # [B, M, H]
        bonus = input_ids.gather(1, first.clamp(max=T - 1)).repeat_interleave(Bk, dim=1)  # [B, M]
        delta = self.calibration(target.embed(bonus.reshape(-1)).view(B, M, -1).to(h.dtype), h)
        logits = target.compute_logits((h + delta).reshape(B * M, -1)).view(B, M, -1)
        label_pos = pos.clamp(max=T - 1)
        labels = input_ids.gather(1, label_pos)  # [B, M]
        jj = j.repeat(num_anchors).unsqueeze(0).expand(B, M)
        valid = (jj >= 1) & (pos < T) & loss_mask.gather(1, label_pos)
        w = torch.exp(-(jj.float() - 1).clamp(min=0) / gamma) * valid
        ce = F.cross_entropy(logits.float().reshape(B * M, -1), labels.reshape(-1), reduction="none").view(
            B, M
        )
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels) & valid
            acc = torch.stack(
                [
                    correct[jj == i].float().sum() / valid[jj == i].float().sum().clamp(min=1)
                    for i in range(1, Bk)
                ]
            )
        return loss, {"acc_per_pos": acc, "num_labels": valid.sum()}

    def dense_side_hidden(
        self,
        target: LlamaForCausalLM,
        input_ids: torch.Tensor,  # [B, T]
        anchors: torch.Tensor,  # [B, A] context ends: group a sees positions <= anchors[b, a]
    ) -> torch.Tensor:  # [B, A * block_size, H] final-norm hidden of the mask tokens
        """Dense (training / reference) computation of mask-token hidden states for blocks placed after each
        anchor. Differentiable in this module's parameters; the target is run without gradients."""
        B, T = input_ids.shape
        A = anchors.shape[1]
        Bk = self.cfg.block_size
        dev = input_ids.device
        with torch.no_grad():
            ctx_kv = _dense_target_kv(
                target, input_ids, self.cfg.split_layer
            )  # per tuned layer [B, T, Hkv, D]
        j = torch.arange(Bk, device=dev)
        pos = (anchors.unsqueeze(-1) + 1 + j).reshape(B, -1)  # [B, M]
        M = A * Bk
        group = torch.arange(A, device=dev).repeat_interleave(Bk)  # [M]
        ctx_vis = torch.arange(T, device=dev).view(1, 1, T) <= anchors.repeat_interleave(Bk, dim=1).unsqueeze(
            -1
        )
        own_vis = (group.view(M, 1) == group.view(1, M)).unsqueeze(0).expand(B, M, M)
        visible = torch.cat([ctx_vis, own_vis], dim=-1).unsqueeze(1)  # [B, 1, M, T + M]
        max_pos = target.spec.max_position_embeddings - 1
        sx = self.mask_embedding.to(ctx_kv[0][0].dtype).expand(B, M, -1)
        sres = None
        for li, (layer_idx, tuned) in enumerate(zip(self.cfg.tuned_layer_ids, self.layers)):
            tl = target.layers[layer_idx]
            if sres is None:
                sres, h = sx, tl.input_layernorm(sx)
            else:
                h, sres = tl.input_layernorm.forward_residual(sx, sres)
            a = tuned.self_attn
            q, k, v = a.qkv_proj(h).split([a.qkv_proj.q_size, a.qkv_proj.kv_size, a.qkv_proj.kv_size], dim=-1)
            q = q.reshape(B * M, a.num_heads, a.head_dim)
            k = k.reshape(B * M, a.num_kv_heads, a.head_dim)
            v = v.reshape(B, M, a.num_kv_heads, a.head_dim)
            if a.q_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = a.rotary(pos.reshape(-1).clamp(max=max_pos), q, k)
            ck, cv = ctx_kv[li]
            keys = torch.cat([ck, k.view(B, M, a.num_kv_heads, a.head_dim)], dim=1).transpose(1, 2)
            vals = torch.cat([cv, v], dim=1).transpose(1, 2)
            qh = q.view(B, M, a.num_heads, a.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qh, keys, vals, attn_mask=visible, scale=a.attn.scale, enable_gqa=True
            )
            o = a.o_proj(o.transpose(1, 2).reshape(B, M, -1))  # [B, M, H]
            o, sres = tl.post_attention_layernorm.forward_residual(o, sres)
            sx = tl.mlp(o)
        return target.norm(sx + sres)


class _TunedLayer(nn.Module):
    def __init__(self, attn: LlamaAttention) -> None:
        super().__init__()
        self.self_attn = attn


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {list(src.shape)}, expected {list(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def _dense_target_kv(
    target: LlamaForCausalLM, input_ids: torch.Tensor, from_layer: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Causal dense forward of the frozen target over [B, T]; returns post-RoPE (k, v) [B, T, Hkv, D] of every
    layer >= ``from_layer`` (what the KV cache would hold). TP=1."""
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).repeat(B)
    x = target.embed(input_ids.reshape(-1)).view(B, T, -1)
    residual = None
    out = []
    for i, layer in enumerate(target.layers):
        if residual is None:
            residual, h = x, layer.input_layernorm(x)
        else:
            h, residual = layer.input_layernorm.forward_residual(x, residual)
        a = layer.self_attn
        q, k, v = a.qkv_proj(h).split([a.qkv_proj.q_size, a.qkv_proj.kv_size, a.qkv_proj.kv_size], dim=-1)
        q = q.reshape(B * T, a.num_heads, a.head_dim)
        k = k.reshape(B * T, a.num_kv_heads, a.head_dim)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = a.rotary(pos, q, k)
        k4 = k.view(B, T, a.num_kv_heads, a.head_dim)
        v4 = v.reshape(B, T, a.num_kv_heads, a.head_dim)
        if i >= from_layer:
            out.append((k4, v4))
        o = F.scaled_dot_product_attention(
            q.view(B, T, a.num_heads, a.head_dim).transpose(1, 2),
            k4.transpose(1, 2),
            v4.transpose(1, 2),
            is_causal=True,
            scale=a.attn.scale,
            enable_gqa=True,
        )
        o = a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        o, residual = layer.post_attention_layernorm.forward_residual(o, residual)
        x = layer.mlp(o)
    return out
