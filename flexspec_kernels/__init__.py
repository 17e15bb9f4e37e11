"""Triton kernels with plain-torch references; imports only torch and triton.

Each op ``<op>`` dispatches on ``backend``: ``"auto"`` runs ``<op>_triton`` for CUDA tensors and
``<op>_ref`` otherwise; ``"triton"`` / ``"torch"`` force one. On CPU the Triton path runs only under
the interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported).
"""

from .activation import act_and_mul, act_and_mul_ref, act_and_mul_triton
from .argmax import argmax, argmax_triton
from .attention import pack_masks, paged_attention, paged_attention_ref, paged_attention_triton
from .expansion import MaskGroups, expand_mask_groups, expand_mask_groups_ref, expand_mask_groups_triton
from .kv_cache import store_kv_cache, store_kv_cache_ref, store_kv_cache_triton
from .norm import rms_norm, rms_norm_ref, rms_norm_triton
from .rejection import (
    PLACEHOLDER_TOKEN_ID,
    num_emitted,
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
)
from .rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton
from .top1 import top1_softmax, top1_softmax_ref, top1_softmax_triton

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "MaskGroups",
    "act_and_mul",
    "act_and_mul_ref",
    "act_and_mul_triton",
    "argmax",
    "argmax_triton",
    "expand_mask_groups",
    "expand_mask_groups_ref",
    "expand_mask_groups_triton",
    "num_emitted",
    "pack_masks",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
    "rejection_sample",
    "rejection_sample_ref",
    "rejection_sample_triton",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_triton",
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_embedding_triton",
    "store_kv_cache",
    "store_kv_cache_ref",
    "store_kv_cache_triton",
    "top1_softmax",
    "top1_softmax_ref",
    "top1_softmax_triton",
]
