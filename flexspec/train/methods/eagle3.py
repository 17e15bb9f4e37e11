"""EAGLE-3 training with training-time test (Li et al., arXiv 2503.01840, section 3.2).

Chain p (one per position) follows the drafting convention of :mod:`flexspec.spec.models.feature_chain`: step
0 feeds (``fc`` of the target's low/mid/high features at p, embedding of token p+1) at position p and predicts
token p+2; step j >= 1 feeds (the layer's own pre-norm output of step j-1, embedding of TRUE token p+1+j) at
position p+j and predicts token p+2+j. Attention of chain p at step j sees the step-0 keys of positions <= p
(what the drafter's cache holds from target features) plus its own keys of steps 1..j (the scratch positions
of earlier draft steps) — EAGLE-3's "diagonal" TTT mask. Step j's CE is weighted 0.8^j."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flexspec.spec.models.checkpoint import save_checkpoint
from flexspec.spec.models.eagle3_model import Eagle3DraftConfig, Eagle3DraftModel
from flexspec.train.data import Batch
from flexspec.train.methods.base import Metrics, TrainMethod, position_metrics

if TYPE_CHECKING:
    from flexspec.models.spec import ModelSpec
    from flexspec.train.target import FrozenTarget

STEP_DECAY = 0.8


def ttt_forward(
    net: Eagle3DraftModel,
    batch: Batch,
    target: FrozenTarget,
    features: torch.Tensor,  # [B, T, 3 * H_t]
    steps: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Unrolled TTT. Returns per step j: final-norm hidden of labelled rows [M_j, H], labels [M_j], and the
    validity grid [B, P] (P = T - 1 chains) that selects those rows."""
    ids, loss_mask = batch.input_ids, batch.loss_mask
    B, T = ids.shape
    P = T - 1
    dev = ids.device
    layer = net.midlayer
    attn = layer.self_attn
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = Hq // Hkv
    scale = D**-0.5
    p = torch.arange(P, device=dev)
    causal = p[None, :] <= p[:, None]  # [P query, P key]
    hidden = net.fuse(features[:, :P])  # [B, P, H]
    k0h = v0h = None
    diag_k: list[torch.Tensor] = []  # step >= 1 keys [B, Hq, P, D]
    diag_v: list[torch.Tensor] = []
    hiddens, labels, valids = [], [], []
    for j in range(steps):
        tok = ids.gather(1, (p + 1 + j).clamp(max=T - 1).expand(B, P))  # [B, P]
        emb = target.embed(tok)  # [B, P, H]
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb).to(normed.dtype), normed], dim=-1)  # [B, P, 2H]
        q = attn.q_proj(x).reshape(B * P, Hq, D)
        k = attn.k_proj(x).reshape(B * P, Hkv, D)
        v = attn.v_proj(x).view(B, P, Hkv, D)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rotary((p + j).repeat(B), q, k)
        qh = q.view(B, P, Hq, D).transpose(1, 2)  # [B, Hq, P, D]
        kh = k.view(B, P, Hkv, D).repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, P, D]
        vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
        if j == 0:
            k0h, v0h = kh, vh
        else:
            diag_k.append(kh)
            diag_v.append(vh)
        assert k0h is not None and v0h is not None
        s0 = (qh @ k0h.transpose(-1, -2)).float() * scale  # [B, Hq, P, P]
        s0 = s0.masked_fill(~causal, float("-inf"))
        sd = [(qh * kd).sum(-1, keepdim=True).float() * scale for kd in diag_k]  # [B, Hq, P, 1] each
        prob = torch.softmax(torch.cat([s0, *sd], dim=-1), dim=-1).to(qh.dtype)
        o = prob[..., :P] @ v0h
        for i, vd in enumerate(diag_v):
            o = o + prob[..., P + i : P + i + 1] * vd
        o = attn.o_proj(o.transpose(1, 2).reshape(B, P, Hq * D))
        h1 = residual + o
        out = h1 + layer.mlp(layer.post_attention_layernorm(h1))  # [B, P, H] pre-norm, fed back
        lab_pos = p + 2 + j
        valid = (lab_pos < T) & loss_mask.gather(1, lab_pos.clamp(max=T - 1).expand(B, P))  # [B, P]
        hiddens.append(net.norm(out[valid]))
        labels.append(ids.gather(1, lab_pos.clamp(max=T - 1).expand(B, P))[valid])
        valids.append(valid)
        hidden = out
    return hiddens, labels, valids


class Eagle3Method(TrainMethod):
    name: ClassVar[str] = "eagle3"

    def draft_config(self, spec: ModelSpec) -> Eagle3DraftConfig:
        return Eagle3DraftConfig.for_target(spec)

    def feature_layers(self, spec: ModelSpec) -> list[int]:
        return list(self.draft_config(spec).target_layer_ids)

    def build(self, target: FrozenTarget) -> nn.Module:
        torch.manual_seed(self.cfg.seed)
        model = Eagle3DraftModel(self.draft_config(target.spec))
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, 0.02)
        return model.to(target.device)

    def load(self, folder: Path, target: FrozenTarget) -> nn.Module:
        model = Eagle3DraftModel.from_pretrained(
            folder, target.spec, device=target.device, dtype=torch.float32
        )
        return model.requires_grad_(True)

    def save(self, model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
        assert isinstance(model, Eagle3DraftModel)
        state = {
            n: t.detach().to(dtype) if t.is_floating_point() else t for n, t in model.state_dict().items()
        }
        save_checkpoint(folder, model.config.to_dict(), state)

    def loss(self, model, batch, target, features, generator) -> tuple[torch.Tensor, Metrics]:
        assert features is not None
        hiddens, labels, valids = ttt_forward(model, batch, target, features, self.cfg.ttt_steps)
        total = torch.zeros((), device=batch.input_ids.device)
        wsum = 0.0
        B, P = valids[0].shape
        correct = torch.zeros(B, P, len(valids), dtype=torch.bool, device=batch.input_ids.device)
        for j, (h, y, valid) in enumerate(zip(hiddens, labels, valids)):
            logits = model.compute_logits(h, target.lm_head)  # [M_j, V] fp32
            if y.numel():
                total = total + STEP_DECAY**j * F.cross_entropy(logits, y)
                wsum += STEP_DECAY**j
            correct[..., j][valid] = logits.detach().argmax(-1) == y
        grid_valid = torch.stack(valids, dim=-1)  # [B, P, J]
        loss = total / max(wsum, 1e-6)
        return loss, position_metrics(correct.view(-1, len(valids)), grid_valid.view(-1, len(valids)))
