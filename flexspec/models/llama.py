"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norms)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from flexspec.distributed import TPGroup
from flexspec.layers import fused
from flexspec.layers.activation import SiluAndMul
from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flexspec.layers.fused import use_skinny
from flexspec.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from flexspec.layers.norm import RMSNorm
from flexspec.layers.rotary import RotaryEmbedding
from flexspec.models.features import FeatureCache, store_features
from flexspec.models.side_stream import SideStream
from flexspec.models.spec import ModelSpec
from flexspec_kernels.attention_split import SplitKVPartials
from flexspec_kernels.skinny_attention import decode_fusion_rows, skinny_qkv_rope
from flexspec_kernels.skinny_linear import Capture, skinny_linear
from flexspec_kernels.skinny_merge import skinny_merge_linear


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        tp: TPGroup,
        rotary: RotaryEmbedding,
        scale: float | None = None,
        sliding_window: int | None = None,
        norm_offset: bool = False,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.attention_bias, tp
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = spec.head_dim
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, False, tp, in_range=self.qkv_proj.q_range
        )
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, norm_offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, norm_offset) if spec.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            spec.head_dim,
            scale if scale is not None else spec.head_dim**-0.5,
            sliding_window=sliding_window,
            logits_soft_cap=spec.attn_logit_softcapping,
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.o_proj(self.attend(self.qkv_proj(x), meta))

    def attend(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T, (Hq + 2 Hkv) * D] projected q|k|v -> [T, Hq * D] attention output (q/k norms, RoPE, K/V
        written to the paged cache), before ``o_proj``."""
        T = qkv.shape[0]
        q, k, v = qkv.split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
            ],
            dim=-1,
        )
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        attn = self.attn
        if attn.k_cache.numel() and self.rotary.fusable(meta.positions, q, k):  # RoPE + cache write: 1 launch
            q, k = self.rotary.forward_and_store(
                meta.positions, q, k, v, attn.k_cache, attn.v_cache, meta.slot_mapping
            )
            o = attn(q, k, v, meta, kv_stored=True)  # [T, Hq, D]
        else:
            q, k = self.rotary(meta.positions, q, k)
            o = attn(q, k, v, meta)
        return o.reshape(T, -1)

    def decode_fusable(self, x: torch.Tensor) -> bool:
        """Whether :meth:`attend_decode` serves this step: <= ``flexspec_kernels.skinny_attention.decode_fusion_rows`` rows
        (2, or 4 with programmatic dependent launch), a bound
        contiguous KV cache, no q/k norms (they sit between the projection and RoPE), RoPE's Triton conditions,
        and the decode fusions on (``flexspec.layers.fused.DECODE_FUSIONS``). Called inside the skinny path only."""
        cache = self.attn.k_cache
        return (
            fused.DECODE_FUSIONS
            and x.shape[0] <= decode_fusion_rows(x)
            and self.q_norm is None
            and cache.numel() > 0
            and cache.is_contiguous()
            and self.attn.v_cache.is_contiguous()
            and (self.head_dim // 2) & (self.head_dim // 2 - 1) == 0
        )

    def attend_decode(
        self, x: torch.Tensor, meta: AttentionMetadata, norm: nn.Module
    ) -> torch.Tensor | SplitKVPartials:
        """``norm`` + QKV + RoPE + KV-cache write in one launch (``flexspec_kernels.skinny_attention.skinny_qkv_rope``),
        then attention over the residual stream ``x`` [T, H] (T <= 4), with split-KV partial states left
        unmerged for the O launch to merge: [T, Hq * D] or :class:`~flexspec_kernels.attention_split.SplitKVPartials`."""
        T, attn = x.shape[0], self.attn
        qkv = skinny_qkv_rope(
            x, self.qkv_proj.weight, self.qkv_proj.bias, meta.positions, self.rotary.cos, self.rotary.sin,
            self.num_heads, self.num_kv_heads,
            norm_weight=norm.weight, eps=norm.eps, norm_offset=norm.offset,
            k_cache=attn.k_cache, v_cache=attn.v_cache, slot_mapping=meta.slot_mapping,
        )  # fmt: skip
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        o = attn(
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            meta,
            kv_stored=True,
            merge=False,
        )
        return o if isinstance(o, SplitKVPartials) else o.reshape(T, -1)


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, act: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [spec.intermediate_size] * 2, False, tp
        )
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, False, tp)
        self.act = act if act is not None else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, tp, rotary)
        self.mlp = LlamaMLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(x, meta)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual

    def forward_skinny(
        self, h: torch.Tensor, meta: AttentionMetadata, capture: Capture | None = None
    ) -> torch.Tensor:
        """The layer over the residual stream ``h`` [T, H] (T <= ``flexspec_kernels.skinny_linear.MAX_ROWS``), updated
        in place and returned: norm+QKV, RoPE+cache write, attention, O+residual, norm+gate-up+activation,
        down+residual (6 launches on CUDA instead of 9). At <= ``flexspec_kernels.skinny_attention.decode_fusion_rows``
        rows (batch-1/2 decode; 1-4 with PDL) RoPE + cache write go into the QKV launch and split-KV attention's merge into the
        O launch (4-5 launches). ``capture``: the layer's output also copied out by the down GEMM (see
        ``skinny_after_attention``). TP = 1 only (the residual adds follow O and down, which at TP > 1 need
        their all-reduce first). Same rounding points as ``forward``."""
        attn = self.self_attn
        if attn.decode_fusable(h):
            return self.skinny_after_attention(attn.attend_decode(h, meta, self.input_layernorm), h, capture)
        return self.skinny_after_attention(attn.attend(self.skinny_qkv(h), meta), h, capture)

    def skinny_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """norm + QKV in one launch: [T, H] -> [T, (Hq + 2 Hkv) * D]."""
        attn, ln = self.self_attn, self.input_layernorm
        return skinny_linear(
            h,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            norm_weight=ln.weight,
            eps=ln.eps,
            norm_offset=ln.offset,
        )

    def skinny_after_attention(
        self, o: torch.Tensor | SplitKVPartials, h: torch.Tensor, capture: Capture | None = None
    ) -> torch.Tensor:
        """O + residual, norm + gate-up + activation, down + residual: attention output [T, Hq * D] (or its
        unmerged split-KV partial states) into the residual stream ``h`` [T, H] (in place; returned). With
        ``capture`` the down GEMM also writes the layer's output there (a copy, and a feature-cache row)."""
        attn, mlp, ln = self.self_attn, self.mlp, self.post_attention_layernorm
        if isinstance(o, SplitKVPartials):  # split-KV attention left unmerged (``attend_decode``)
            skinny_merge_linear(o.part_out, o.part_ml, attn.o_proj.weight, attn.o_proj.bias, residual=h)
        else:
            skinny_linear(o, attn.o_proj.weight, attn.o_proj.bias, residual=h)
        act = skinny_linear(
            h,
            mlp.gate_up_proj.weight,
            norm_weight=ln.weight,
            eps=ln.eps,
            norm_offset=ln.offset,
            activation=mlp.act.activation,
        )
        return skinny_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h, capture=capture)

    def forward_with_side(
        self,
        x: torch.Tensor,  # [T, H] target tokens
        residual: torch.Tensor,
        meta: AttentionMetadata,
        sx: torch.Tensor,  # [M, H] side tokens
        sres: torch.Tensor | None,
        side_meta: AttentionMetadata,
        side_attn: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer for target tokens and side tokens: separate attention (target first, so side tokens see
        the K/V it just wrote), shared norms and one MLP GEMM over both."""
        T = x.shape[0]
        x, residual = self.input_layernorm.forward_residual(x, residual)
        if sres is None:
            sres, sx = sx, self.input_layernorm(sx)
        else:
            sx, sres = self.input_layernorm.forward_residual(sx, sres)
        x = self.self_attn(x, meta)
        sx = side_attn(sx, side_meta)
        both, both_res = self.post_attention_layernorm.forward_residual(
            torch.cat([x, sx]), torch.cat([residual, sres])
        )
        both = self.mlp(both)
        return both[:T], both_res[:T], both[T:], both_res[T:]

    def forward_side(
        self, sx: torch.Tensor, sres: torch.Tensor | None, side_meta: AttentionMetadata, side_attn: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer for side tokens only (FlexDraft's decoupled mode)."""
        if sres is None:
            sres, sx = sx, self.input_layernorm(sx)
        else:
            sx, sres = self.input_layernorm.forward_residual(sx, sres)
        sx = side_attn(sx, side_meta)
        sx, sres = self.post_attention_layernorm.forward_residual(sx, sres)
        return self.mlp(sx), sres


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. ``forward`` returns final hidden states [T, H] and the captured layer outputs."""

    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Bound by a drafter that reads target hidden states per KV slot (DFlash ``defer_context``): forwards that
    # capture its layers also write them there (``flexspec.models.features``).
    feature_cache: FeatureCache | None = None

    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, tp, rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # skinny fused GEMMs need plain Llama MLPs without biases on gate/up (every family this file loads)
        self.skinny_ok = all(
            layer.mlp.gate_up_proj.bias is None and hasattr(layer.mlp.act, "activation")
            for layer in self.layers
        )
        self.skinny_max_rows = 0  # "auto" mode: set by ``tune_skinny`` on CUDA
        self.skinny_timing: dict[int, dict[str, float]] = {}

    @torch.inference_mode()
    def tune_skinny(self, rows: tuple[int, ...] = (1, 2, 4, 8, 16)) -> int:
        """Measures, for each row count, the decoder's GEMMs with their neighbouring ops unfused (add + norm +
        QKV, O, add + norm + gate-up + activation, down: Triton + cuBLAS) and fused (``forward_skinny``'s four
        launches), over every layer's weights (as a decode step reads them: from HBM, not from L2), each as
        one CUDA graph on this GPU. Sets and returns ``skinny_max_rows``: the largest row count up to which
        the fused form was faster by >= ``SKINNY_MIN_GAIN`` at every measured count (0: never). Timings (us
        per layer) go to ``skinny_timing``."""
        from flexspec.layers.fused import SKINNY_MIN_GAIN, graph_time_us

        w = next(self.parameters())
        self.skinny_max_rows, self.skinny_timing = 0, {}
        faster_so_far = True
        for r in rows:
            h = torch.randn(r, self.spec.hidden_size, device=w.device, dtype=w.dtype)
            res = h.clone()
            o = torch.randn(r, self.layers[0].self_attn.qkv_proj.q_size, device=w.device, dtype=w.dtype)

            def unfused(h=h, res=res, o=o):
                for layer in self.layers:
                    attn, mlp = layer.self_attn, layer.mlp
                    x, rr = layer.input_layernorm.forward_residual(h, res)
                    attn.qkv_proj(x)
                    x, rr = layer.post_attention_layernorm.forward_residual(attn.o_proj(o), rr)
                    mlp.down_proj(mlp.act(mlp.gate_up_proj(x)))

            def fused(res=res, o=o):  # forward_skinny without its attention
                for layer in self.layers:
                    layer.skinny_qkv(res)
                    layer.skinny_after_attention(o, res)

            n = len(self.layers)
            t = {
                "unfused_us": graph_time_us(unfused, repeat=1) / n,
                "fused_us": graph_time_us(fused, repeat=1) / n,
            }
            self.skinny_timing[r] = t
            faster_so_far = faster_so_far and t["fused_us"] * (1 + SKINNY_MIN_GAIN) < t["unfused_us"]
            if faster_so_far:
                self.skinny_max_rows = r
        return self.skinny_max_rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,  # [T, H] overrides the embedding lookup
        side: SideStream | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (final-norm hidden states [T, H], outputs of ``capture_layers`` [T, H] each, ascending).

        With ``side``, its tokens join at ``side.start_layer``; their final-norm hidden goes to ``side.out``.
        """
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        captured: list[torch.Tensor] = []
        if (
            side is None
            and self.tp.size == 1
            and self.skinny_ok
            and use_skinny(x, max_rows=self.skinny_max_rows)
        ):
            h = x if inputs_embeds is None else x.clone()  # the residual stream, updated in place
            cache = self.feature_cache
            if cache is not None and tuple(capture_layers) != cache.layers:
                cache = None
            slots = meta.slot_mapping[: h.shape[0]]
            for i, layer in enumerate(self.layers):
                capture = None
                if i in capture_layers:  # the down GEMM copies the layer's output (and its feature-cache row)
                    buf = torch.empty_like(h)
                    captured.append(buf)
                    col = (len(captured) - 1) * h.shape[1]
                    capture = Capture(buf, cache.data, col, slots) if cache is not None else Capture(buf)
                layer.forward_skinny(h, meta, capture)
            return self.norm(h), captured
        residual = None
        sx, sres = (side.hidden, None) if side is not None else (None, None)
        for i, layer in enumerate(self.layers):
            if side is not None and i >= side.start_layer:
                assert residual is not None and sx is not None, "side stream cannot start at layer 0"
                x, residual, sx, sres = layer.forward_with_side(
                    x, residual, meta, sx, sres, side.meta, side.attn[i - side.start_layer]
                )
            else:
                x, residual = layer(x, residual, meta)
            if i in capture_layers:
                captured.append(x + residual)
        store_features(self, captured, capture_layers, meta.slot_mapping)
        x, _ = self.norm.forward_residual(x, residual)
        if side is not None:
            side.out = self.norm(sx + sres) if sres is not None else self.norm(sx)
        return x, captured

    def forward_side_only(self, side: SideStream) -> torch.Tensor:
        """Run only layers >= side.start_layer over the side tokens; returns final-norm hidden [M, H]."""
        sx, sres = side.hidden, None
        for i in range(side.start_layer, len(self.layers)):
            sx, sres = self.layers[i].forward_side(sx, sres, side.meta, side.attn[i - side.start_layer])
        side.out = self.norm(sx + sres) if sres is not None else self.norm(sx)
        return side.out

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Final-norm hidden states [N, H] -> logits [N, V]: fp32, or with ``upcast=False`` the LM head's own
        dtype (bf16 on GPU) for consumers that upcast themselves (the engine's sampler, verifier and argmax
        kernels: a [N, V] fp32 copy costs ~0.1 ms at N = 1024 on an H100)."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits
