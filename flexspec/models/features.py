"""Target hidden states kept per KV-cache slot, next to the target's KV cache (drafters fed with them).

A drafter that conditions on target hidden states (DFlash, DSpark) reads the outputs of a few target layers
at every committed position. Kept like K/V: row ``slot`` of ``data`` holds the captured layers' outputs of the
token whose K/V live in that slot (same slot mapping, same lifetime: a rejected draft's row is overwritten
when its position is recomputed, as its K/V are). The target forward writes them inside its CUDA graphs, so a
plain decoding step pays one scatter and no host work for its drafter; the drafter turns rows into its own
context K/V only when it drafts for the sequence (``DFlashDrafter``, ``defer_context``).
"""

from __future__ import annotations

import torch


class FeatureCache:
    """``data`` [num_slots + 1, len(layers) * H]: per slot, the outputs of ``layers`` (ascending target layer
    ids, concatenated in that order); the last row is scratch for padded tokens (slot -1)."""

    def __init__(
        self, layers: tuple[int, ...], num_slots: int, hidden_size: int, dtype: torch.dtype, device
    ) -> None:
        self.layers = tuple(layers)
        self.data = torch.zeros(num_slots + 1, len(self.layers) * hidden_size, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
        return num_layers * hidden_size * torch.finfo(dtype).bits // 8

    def store(self, captured: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Write the step's captured outputs ([T, H] per layer of ``layers``) at ``slot_mapping`` [T] int64
        (-1 = padding: written to the scratch row). Sync-free (captured inside CUDA graphs)."""
        feats = captured[0] if len(captured) == 1 else torch.cat(captured, dim=-1)
        scratch = self.data.shape[0] - 1
        self.data.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, scratch), feats)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` [N] int64 -> [N, len(layers) * H]."""
        return self.data.index_select(0, slots)


def store_features(model, captured: list[torch.Tensor], capture_layers, slot_mapping: torch.Tensor) -> None:
    """A target forward's hook: write ``captured`` into ``model.feature_cache`` when one is bound and this
    forward captured exactly its layers."""
    cache = getattr(model, "feature_cache", None)
    if cache is not None and captured and tuple(capture_layers) == cache.layers:
        cache.store(captured, slot_mapping[: captured[0].shape[0]])
