"""DFlash block drafter (arXiv 2602.06036; z-lab/dflash; vLLM PR 36847), method ``dflash``.

Each step, for every sequence of the batch:
1. *Context*: the target features of the newly committed positions (read in place from this step's target
   forward, ``capture_layers = target_layer_ids``) become each drafter layer's context K/V, written once into
   the drafter's own paged cache (:class:`DraftKVCache`) at those positions. Prefill chunks that emit nothing
   are cached too. With ``defer_context`` (default) plain decoding steps (the policy's choice, nothing
   drafted) write nothing of the drafter's: the target forward keeps the features per KV slot
   (:class:`~flexspec.models.features.FeatureCache`, inside its CUDA graphs) and the whole stretch becomes
   context K/V when the sequence is next drafted for (in the drafting step's context step, or in steps of at
   most ``max_num_batched_tokens`` rows when longer), so a plain step costs what it costs without a drafter
   (one scatter).
2. *Block*: sequences that want drafts run one block ``[bonus, MASK x (B-1)]`` at positions ``L-1 .. L+B-2``
   over their cached context (non-causal inside the block; block K/V are never cached), all sequences in one
   varlen forward. Drafts = argmax of the target's LM head at the first ``k`` mask positions (deterministic
   drafts: the verifier's deterministic-draft rule keeps T > 0 exact), cut by selective verification: only
   the prefix whose cumulative draft probability stays >= ``verification_threshold`` is verified.

On GPU the block forward is one CUDA graph per batch size and the context step one per row count (1, 2, 4, ...
up to ``max(max_num_seqs * B, max_num_batched_tokens)``; ``BatchGraphs``), so prefill steps replay them too.

The device-side step (acceptance and drafting without a host sync in between, eager or captured with the
acceptance test) is :class:`~flexspec.spec.dflash_device.DFlashDeviceStep`, a part of this class.

``num_speculative_tokens`` = min(config's, B - 1). Sequences whose context misses positions (cache evicted
under memory pressure) still draft — worse drafts, same output.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from flexspec.engine.cuda_graphs import BatchGraphs
from flexspec.layers.attention import AttentionMetadata
from flexspec.models.features import FeatureCache
from flexspec.models.loader import resolve_model_dir
from flexspec.spec.base import Drafter, DraftProposal, SeqDraftInput, confident_prefix_len
from flexspec.spec.dflash_device import DFlashDeviceStep, _Held, int64_rows
from flexspec.spec.models.checkpoint import read_config
from flexspec.spec.models.dflash_model import DFlashDraftModel
from flexspec.spec.models.draft_kv import DraftKVCache
from flexspec.spec.registry import register
from flexspec.spec.tree import is_chain, paths_to_tree, top_paths
from flexspec_kernels import pack_masks, top1_softmax

log = logging.getLogger(__name__)


@register
class DFlashDrafter(DFlashDeviceStep, Drafter):
    method = "dflash"
    model_class: ClassVar[type[DFlashDraftModel]] = DFlashDraftModel
    greedy_drafts: ClassVar[bool] = (
        True  # drafts = argmax of the target head (subclasses may select otherwise)
    )
    observes_plain_steps: ClassVar[bool] = True  # plain steps write their context K/V (observe_plain_step)

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        self.target = runner.model
        self.device = runner.device
        folder = resolve_model_dir(config.model)
        block_size = self.model_class.config_class.from_dict(read_config(folder), str(folder)).block_size
        self.model = self.model_class.from_pretrained(
            folder,
            runner.spec,
            max_position=runner.config.max_model_len + block_size,  # block positions reach L - 1 + B - 1
            device=runner.device,
            dtype=runner.dtype,
        )
        self.model.eval().requires_grad_(False)
        cfg = self.model.config
        self.block_size = cfg.block_size
        # Draft trees (``draft_tree_topk`` > 1): num_speculative_tokens counts tree nodes, of depth <= B - 1.
        self.tree_topk: int = getattr(config, "draft_tree_topk", 1)
        limit = 64 if self.tree_topk > 1 else self.block_size - 1
        if config.num_speculative_tokens > limit:  # trees: the config's own bound (64) is the limit
            log.warning(
                "%s: num_speculative_tokens %d, but a chain of block size %d holds %d drafts: using %d "
                "(draft_tree_topk > 1 drafts trees of up to 64 nodes)",
                self.method, config.num_speculative_tokens, self.block_size, limit, limit,
            )  # fmt: skip
        self.num_speculative_tokens = min(config.num_speculative_tokens, limit)
        layers = sorted(set(cfg.target_layer_ids))
        self._capture = tuple(layers)
        self._feature_index = [layers.index(i) for i in cfg.target_layer_ids]  # captured[j] per feature slot
        self.cache = DraftKVCache(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=runner.config.kv_block_size,
            max_tokens_per_seq=runner.config.max_model_len,
            max_num_seqs=runner.config.max_num_seqs,
            dtype=runner.dtype,
            device=runner.device,
        )
        # defer_context: plain steps leave their context K/V for later; the target keeps their hidden states
        # per KV slot (``FeatureCache``, bound in ``allocate``) and ``_pending_from[sid]`` is the first
        # position of the sequence whose drafter K/V is not written yet.
        # Only where plain steps are launched by the runner (one rank, async output processing): elsewhere
        # every step goes through ``propose``, nothing is ever deferred and the cache would be dead memory.
        self.defer_context = (
            bool(getattr(config, "defer_context", False))
            and hasattr(runner.model, "feature_cache")
            and runner.tp.size == 1
            and bool(getattr(runner.config, "async_output_processing", False))
        )
        self.features: FeatureCache | None = None
        self._pending_from: dict[int, int] = {}
        self._noted_ids: list[int] = []  # the batch of the last plain step noted into _pending_from
        self._noted_len = -1  # len(_pending_from) right after it (an entry dropped since: noted again)
        self._packed_masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # S -> packed block masks
        self._graphs: BatchGraphs | None = None  # block forward, captured per batch size on GPU
        self._context_graphs: BatchGraphs | None = None  # context K/V writes, captured per row count on GPU

    # ---- Drafter interface --------------------------------------------------------------------------------
    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self._capture

    @property
    def max_chain_drafts(self) -> int:
        """A chain (also a tree that is one) is at most one block deep."""
        return min(self.num_speculative_tokens, self.block_size - 1)

    @property
    def reads_plain_step_captured(self) -> bool:
        return not self.defer_context  # deferred: the forward writes the feature cache itself

    def memory_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return weights + self.cache.reserved_bytes()

    def kv_bytes_per_block(self) -> int:
        if not self.defer_context:
            return 0
        per_slot = FeatureCache.bytes_per_slot(
            len(self._capture), self.runner.spec.hidden_size, self.runner.dtype
        )
        return self.runner.config.kv_block_size * per_slot

    def allocate(self, num_kv_blocks: int) -> None:
        self.cache.allocate(num_kv_blocks)
        self.cache.bind(self.model.attention_layers())
        if self.defer_context:
            slots = num_kv_blocks * self.runner.config.kv_block_size
            self.features = FeatureCache(
                self._capture, slots, self.runner.spec.hidden_size, self.runner.dtype, self.device
            )
            self.target.feature_cache = self.features

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.cache.free(sid)
            self._pending_from.pop(sid, None)

    @torch.inference_mode()
    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        ready = self._store_context(batch, captured)
        out: list[list[int]] = [[] for _ in batch]
        todo = [(i, b) for i, b in enumerate(batch) if b.num_drafts > 0 and b.emitted and b.seq_id in ready]
        if not todo:
            return DraftProposal(token_ids=out)
        drafts, trees = self._draft([b for _, b in todo])
        parents: list[list[int] | None] = [None] * len(batch) if trees is not None else []
        for j, (i, _) in enumerate(todo):
            out[i] = drafts[j]
            if trees is not None and not is_chain(trees[j]):
                parents[i] = trees[j]
        return DraftProposal(token_ids=out, parents=parents)

    # ---- steps --------------------------------------------------------------------------------------------
    def _store_context(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> set[int]:
        """Cache the context K/V of this step's committed positions; returns the sequences with a cache."""
        evictable = set(self.cache.tables) - {b.seq_id for b in batch}
        ready: set[int] = set()
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        held: _Held = ([], [], [])
        for b in batch:
            L = len(b.token_ids)
            end = L - 1 if b.emitted else L  # committed positions with hidden states: [end - n, end)
            if not self.cache.reserve(b.seq_id, max(end, L - 1, 1), evictable):
                self._pending_from.pop(b.seq_id, None)
                continue
            ready.add(b.seq_id)
            self._take_pending(b.seq_id, end - b.num_new_committed, b.block_table, held)
            for row, pos in zip(b.hidden_rows, range(end - b.num_new_committed, end)):
                rows.append(row)
                positions.append(pos)
                slots.append(self.cache.slot(b.seq_id, pos))
        self._write_context(rows, positions, slots, captured, self._flush_if_large(held, captured))
        return ready

    def observe_plain_step(self, inp, captured: list[torch.Tensor]) -> None:
        """Plain step (see ``Drafter.observe_plain_step``): all of its inputs are committed. With
        ``defer_context`` the target forward has already written their hidden states into the feature cache,
        so only the first unwritten position of each sequence is noted (no device work): the context K/V of
        the whole stretch is written in one batch when the sequence is next drafted for (``_take_pending``).
        Otherwise it is written now, enqueued without waiting for the device (the context step is the captured
        graph up to its row count, eager beyond). DSpark inherits this."""
        if self.defer_context:
            # The same batch as the last plain step, with no entry dropped since: every sequence's first unwritten
            # position is noted already (its context only grew). Skips a loop over the batch on most plain steps.
            if inp.seq_ids == self._noted_ids and len(self._pending_from) == self._noted_len:
                return
            pending = self._pending_from
            for sid, ctx in zip(inp.seq_ids, inp.context_lens):
                first = pending.get(sid)
                if first is None or first > ctx:
                    pending[sid] = ctx
            self._noted_ids, self._noted_len = list(inp.seq_ids), len(pending)
            return
        self._write_plain_context(inp, captured)

    @torch.inference_mode()
    def _write_plain_context(self, inp, captured: list[torch.Tensor]) -> None:
        """``observe_plain_step`` without ``defer_context``: the step's context K/V, enqueued now."""
        evictable = set(self.cache.tables) - set(inp.seq_ids)
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        r = 0
        for sid, ctx, n in zip(inp.seq_ids, inp.context_lens, inp.query_lens):
            if self.cache.reserve(sid, max(ctx + n, 1), evictable):
                rows.extend(range(r, r + n))
                positions.extend(range(ctx, ctx + n))
                slots.extend(self.cache.slot(sid, p) for p in range(ctx, ctx + n))
            r += n
        self._write_context(rows, positions, slots, captured)

    def _take_pending(self, seq_id: int, before: int, block_table: list[int], held: _Held) -> None:
        """Move ``seq_id``'s unwritten context positions below ``before`` into ``held`` (target KV slots from
        ``block_table``, positions, drafter cache slots) for the next context write. The drafter cache must
        already hold them (``reserve``); positions it lost to eviction are skipped."""
        first = self._pending_from.pop(seq_id, None)
        if first is None or first >= before:
            return
        table = self.cache.tables.get(seq_id, [])
        bs = self.cache.block_size  # = the target's block size
        # one range per KV block (after a long plain stretch a batch holds thousands of positions: session 30,
        # H100, b=64, a loop per position made the step entering speculation 11-42 ms)
        for b in range(first // bs, min(-(-before // bs), len(table), len(block_table))):
            lo, hi = max(first, b * bs), min(before, (b + 1) * bs)
            target, drafter = block_table[b] * bs - b * bs, table[b] * bs - b * bs
            held[0].extend(range(target + lo, target + hi))
            held[1].extend(range(lo, hi))
            held[2].extend(range(drafter + lo, drafter + hi))

    def _flush_if_large(self, held: _Held, captured: list[torch.Tensor]) -> _Held:
        """Write ``held`` now, in context steps of at most ``max_num_batched_tokens`` rows, when it is larger
        than that (a long plain stretch or whole prompts prefilled plainly: one step would need activations for
        all of it); returns what is left to merge into the step's own context write."""
        limit = max(self.runner.config.max_num_batched_tokens, 1)
        if len(held[0]) <= limit:
            return held
        for i in range(0, len(held[0]), limit):
            self._write_context(
                [], [], [], captured, (held[0][i : i + limit], held[1][i : i + limit], held[2][i : i + limit])
            )
        return ([], [], [])

    def _held_features(self, target_slots: torch.Tensor) -> torch.Tensor:
        """Feature-cache rows at ``target_slots`` [N] -> drafter features [N, n*H] (``target_layer_ids`` order)."""
        assert self.features is not None
        feats = self.features.gather(target_slots)  # layers in ascending order
        if self._feature_index != list(range(len(self._capture))):  # reordered or repeated layer ids
            n = len(self._capture)
            feats = feats.view(feats.shape[0], n, -1)[:, self._feature_index].reshape(feats.shape[0], -1)
        return feats

    def _write_context(
        self,
        rows: list[int],
        positions: list[int],
        slots: list[int],
        captured: list[torch.Tensor],
        held: _Held = ((), (), ()),
    ) -> None:
        """Drafter context K/V of captured rows ``rows`` (target features) at ``positions`` / drafter cache
        ``slots``, and of the feature cache's rows ``held[0]`` at positions ``held[1]`` / slots ``held[2]``:
        one context step (the captured context graph up to its row count, eager beyond)."""
        num_held = len(held[0])
        n = num_held + len(rows)
        if not n:
            return
        src, positions_t, slots_t = int64_rows(
            [[*held[0], *rows], [*held[1], *positions], [*held[2], *slots]]
        ).to(self.device, non_blocking=True)
        parts = []
        if num_held:
            parts.append(self._held_features(src[:num_held]))
        if rows:
            parts.append(
                torch.cat([captured[j].index_select(0, src[num_held:]) for j in self._feature_index], dim=-1)
            )
        feats = parts[0] if len(parts) == 1 else torch.cat(parts, 0)  # [N, n*H]
        graphs = self._context_graphs
        if graphs is not None and graphs.can_run(n):
            graphs.run(n, feats=feats, positions=positions_t, slots=slots_t)
        else:
            self.model.store_context(feats, positions_t, slots_t)

    def _draft(self, items: list[SeqDraftInput]) -> tuple[list[list[int]], list[list[int]] | None]:
        """One varlen forward of S blocks -> (drafts per sequence, their trees' parents or None for chains); a
        CUDA graph replay when captured."""
        dev, S = self.device, len(items)
        bonus = torch.tensor([b.token_ids[-1] for b in items]).to(dev, non_blocking=True)
        ctx_lens = torch.tensor([len(b.token_ids) - 1 for b in items], dtype=torch.int32).to(
            dev, non_blocking=True
        )
        tables = [self.cache.tables[b.seq_id] for b in items]
        width = max(len(t) for t in tables) or 1
        tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).to(dev)
        graphs = self._graphs
        if self.tree_topk > 1:
            if graphs is not None and graphs.can_run(S, tables=tables_t):
                (top,) = graphs.run(S, bonus=bonus, ctx_lens=ctx_lens, tables=tables_t)
            else:
                top = self._topk_block(bonus, ctx_lens, tables_t)[0]
            return self._trees(items, top)
        if graphs is not None and graphs.can_run(S, tables=tables_t):
            greedy, keep = graphs.run(S, bonus=bonus, ctx_lens=ctx_lens, tables=tables_t)
            return self._cut(items, greedy, keep), None
        K = max(min(b.num_drafts, self.num_speculative_tokens) for b in items)
        hidden = self._block_hidden(bonus, ctx_lens, tables_t)[:, :K]  # [S, K, H]
        logits = self.model.compute_logits(hidden.reshape(S * K, -1), self.target.lm_head).view(S, K, -1)
        return self._select(items, hidden, logits), None

    def _block_hidden(
        self, bonus: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor
    ) -> torch.Tensor:
        """Blocks ``[bonus, MASK x (B-1)]`` at positions ctx_len .. ctx_len+B-1 over each sequence's cached
        context. bonus [S] int64, ctx_lens [S] int32, tables [S, W] int32 (drafter cache) -> hidden of the mask
        positions [S, B-1, H]. Sync-free (captured in CUDA graphs)."""
        B, S, dev = self.block_size, bonus.shape[0], bonus.device
        ids = torch.cat([bonus[:, None], bonus.new_full((S, B - 1), self.model.mask_token_id)], 1).view(-1)
        positions = (ctx_lens[:, None].long() + torch.arange(B, device=dev)).view(-1)  # [S*B]
        mask, mask_start_loc = self._block_masks(S)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=torch.full_like(positions, -1),  # block K/V are never cached
            block_tables=tables,
            context_lens=ctx_lens,
            query_start_loc=torch.arange(0, (S + 1) * B, B, dtype=torch.int32, device=dev),
            max_query_len=B,
            mask=mask,
            mask_start_loc=mask_start_loc,
        )
        embeds = self.target.embed_tokens(ids)  # [S*B, H]
        if self.model.config.input_embedding_scale != 1.0:
            embeds = embeds * self.model.config.input_embedding_scale
        return self.model(embeds, meta).view(S, B, -1)[:, 1:]

    def _greedy_block(
        self, bonus: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_block_hidden`` + target LM head -> ``_greedy`` over the first ``num_speculative_tokens`` mask
        positions (the ones that can become drafts): the captured step."""
        hidden = self._block_hidden(bonus, ctx_lens, tables)[:, : self.num_speculative_tokens]
        S, n = hidden.shape[:2]
        # the LM head's own dtype: top1_softmax upcasts in registers (no fp32 copy of [S*n, V])
        logits = self.model.compute_logits(hidden.reshape(S * n, -1), self.target.lm_head, upcast=False)
        return self._greedy(logits.view(S, n, -1))

    def _topk_block(
        self, bonus: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor
    ) -> tuple[torch.Tensor]:
        """``_block_hidden`` + target LM head -> (top-R candidates at every mask position, [S, B-1, 2R] fp64:
        probabilities then token ids, one tensor for one readback). Sync-free (the captured step of trees)."""
        hidden = self._block_hidden(bonus, ctx_lens, tables)
        S, n = hidden.shape[:2]
        logits = self.model.compute_logits(hidden.reshape(S * n, -1), self.target.lm_head)
        probs, ids = logits.view(S, n, -1).softmax(-1).topk(self.tree_topk, dim=-1)
        return (torch.cat([probs.double(), ids.double()], -1),)

    def _trees(
        self, items: list[SeqDraftInput], top: torch.Tensor
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Candidates [S, B-1, 2R] (``_topk_block``) -> (draft tokens, parents) of each sequence's dynamic tree:
        the ``_node_budget`` rank paths of highest probability product whose product stays >=
        ``verification_threshold`` (``flexspec.spec.tree.top_paths``; at least one node), at most ``num_drafts``
        deep (the tokens the sequence may still emit)."""
        R, threshold = self.tree_topk, self.config.verification_threshold
        nodes = self._node_budget(len(items))
        ids_out, parents_out = [], []
        for b, rows in zip(items, top.tolist()):  # one readback
            probs = [r[:R] for r in rows[: b.num_drafts]]
            tokens = [[int(t) for t in r[R:]] for r in rows]
            ids, parents = paths_to_tree(top_paths(probs, nodes, threshold), tokens)
            ids_out.append(ids)
            parents_out.append(parents)
        return ids_out, parents_out

    def _node_budget(self, num_seqs: int) -> int:
        """Tree nodes per sequence: ``num_speculative_tokens`` within an even share of the step's token budget
        among the sequences drafting now or holding drafter state (the running ones): a query is 1 + nodes
        tokens, and a batch of trees over ``max_num_batched_tokens`` leaves its last requests without a step."""
        share = self.runner.config.max_num_batched_tokens // max(num_seqs, len(self.cache.tables), 1) - 1
        return max(1, min(self.num_speculative_tokens, share))

    def _greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [S, K, V] (any float dtype) -> (argmax drafts [S, K] int64, drafts worth verifying [S] int64,
        see ``verification_threshold``): top-1 token and probability in one pass (``top1_softmax``)."""
        S, K, V = logits.shape
        probs, tokens = top1_softmax(logits.reshape(S * K, V))
        return tokens.view(S, K), confident_prefix_len(probs.view(S, K), self.config.verification_threshold)

    def _cut(self, items: list[SeqDraftInput], drafts: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
        k = self.num_speculative_tokens
        rows = torch.cat([drafts, keep.view(-1, 1).to(drafts.dtype)], 1).tolist()  # one readback
        return [row[: min(b.num_drafts, k, row[-1])] for b, row in zip(items, rows)]

    def _store_context_rows(
        self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The captured context step: feats [N, n*H], positions [N] int64, slots [N] int64 (-1 = pad row)."""
        self.model.store_context(feats, positions, slots)
        return ()

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        cfg = self.runner.config
        # A step commits 1 .. B tokens per sequence, a step that prefills up to max_num_batched_tokens: graphs for
        # row counts 1, 2, 4, .. up to the larger of the two (padded rows have slot -1: nothing is written).
        max_rows = max(cfg.max_num_seqs * self.block_size, cfg.max_num_batched_tokens)
        row_counts = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
        if row_counts[-1] < max_rows:
            row_counts.append(max_rows)
        feat_dim = len(self.model.config.target_layer_ids) * self.runner.spec.hidden_size
        context_inputs = {
            "feats": ((feat_dim,), self.runner.dtype, 0),
            "positions": ((), torch.int64, 0),
            "slots": ((), torch.int64, -1),
        }
        self._context_graphs = BatchGraphs(self._store_context_rows, context_inputs, row_counts, self.device)
        if not self.greedy_drafts:
            return
        sizes = [b for b in batch_sizes if b <= cfg.max_num_seqs]
        width = -(-cfg.max_model_len // cfg.kv_block_size)
        inputs = {
            "bonus": ((), torch.int64, 0),
            "ctx_lens": ((), torch.int32, 0),  # a dummy block reads no context
            "tables": ((width,), torch.int32, 0),
        }
        for S in sizes:  # packed masks are built (host -> device) before capture
            self._block_masks(S)
        step = self._topk_block if self.tree_topk > 1 else self._greedy_block
        self._graphs = BatchGraphs(step, inputs, sizes, self.device) if sizes else None

    def _block_masks(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed non-causal [B, B] masks of ``num_seqs`` blocks (cached per batch size, on the device)."""
        if num_seqs not in self._packed_masks:
            ones = torch.ones(self.block_size, self.block_size, dtype=torch.bool, device=self.device)
            self._packed_masks[num_seqs] = pack_masks([ones] * num_seqs)
        return self._packed_masks[num_seqs]

    def _select(
        self, items: list[SeqDraftInput], hidden: torch.Tensor, logits: torch.Tensor
    ) -> list[list[int]]:
        """hidden [S, K, H], logits [S, K, V] fp32 -> greedy drafts: at most ``num_drafts``, cut by selective
        verification."""
        return self._cut(items, *self._greedy(logits))
