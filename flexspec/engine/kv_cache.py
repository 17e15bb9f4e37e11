"""The target's paged KV cache tensors: binding them to the attention layers and moving slots between them.

Where every attention layer has the same cache shape (the common case), all layers' K/V live in one tensor
``[L, 2, num_blocks, block_size, Hkv, D]`` whose slices are the layers' ``k_cache`` / ``v_cache`` (contiguous
views), so moving slots for all layers, as draft-tree verification does after every step, is one gather and one
scatter; otherwise each layer gets its own pair.
"""

from __future__ import annotations

import torch


def bind_kv_cache(
    layers: list, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Allocate the cache of ``layers`` (``Attention`` modules) and bind it. Returns the one tensor holding every
    layer's K/V, or None when the layers' shapes differ (one pair each).

    On CPU the cache is not zeroed: its pages are committed as blocks are first written (the 1 GiB default is not
    resident from the start), and no CPU path reads an entry before it is written (the attention's gathers mask
    or skip anything past a sequence's tokens). GPU caches start zeroed."""
    alloc = torch.zeros if device.type != "cpu" else torch.empty
    shapes = {(num_blocks, block_size, a.num_kv_heads, a.head_dim) for a in layers}
    if len(shapes) == 1:
        cache = alloc((len(layers), 2, *shapes.pop()), dtype=dtype, device=device)
        for a, kv in zip(layers, cache):
            a.k_cache, a.v_cache = kv[0], kv[1]
        return cache
    for a in layers:
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        a.k_cache = alloc(shape, dtype=dtype, device=device)
        a.v_cache = alloc(shape, dtype=dtype, device=device)
    return None


def move_kv_slots(
    layers: list,
    cache: torch.Tensor | None,
    feature_cache,  # flexspec.models.features.FeatureCache or None
    src_slots: list[int] | torch.Tensor,
    dst_slots: list[int] | torch.Tensor,
) -> None:
    """Copy the K/V of slots ``src_slots`` to ``dst_slots`` in every layer (``cache``: ``bind_kv_cache``'s
    tensor, or None), and the feature cache's rows when a drafter keeps one. Sources are read before any
    destination is written; a destination listed twice must get the same source's value (the device-side tree
    step pads with copies of one move, ``flexspec.spec.tree_device.tree_move_pairs``). Slots as lists or as int64
    tensors on the cache's device. Sync-free."""
    device = layers[0].k_cache.device
    if isinstance(src_slots, torch.Tensor):
        src, dst = src_slots, dst_slots
    else:
        idx = torch.tensor([src_slots, dst_slots], dtype=torch.int64).to(device, non_blocking=True)
        src, dst = idx[0], idx[1]
    if cache is not None:
        flat = cache.view(2 * len(layers), -1, *cache.shape[-2:])  # [2L, slots, Hkv, D]
        flat.index_copy_(1, dst, flat.index_select(1, src))
    else:
        for a in layers:
            for c in (a.k_cache, a.v_cache):
                flat = c.view(-1, *c.shape[2:])  # [num_blocks * block_size, Hkv, D]
                flat.index_copy_(0, dst, flat.index_select(0, src))
    if feature_cache is not None:
        feature_cache.data.index_copy_(0, dst, feature_cache.data.index_select(0, src))
