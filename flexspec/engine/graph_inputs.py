"""Host side of the CUDA graphs' inputs: one staged host buffer per graph family, sent with one copy per step, and
the layouts written into it (:mod:`flexspec.engine.cuda_graphs` replays the graphs that read them)."""

from __future__ import annotations

import numpy as np
import torch

from flexspec.engine.model_input import ModelInput

# Host staging switches from Python lists to numpy above these batch sizes (numpy's fixed cost per call, ~1 us,
# beats a per-sequence loop only past a few sequences; ``bench.host_staging``): the decode-graph layout of
# verification queries, and a fused tail's draft rows.
SMALL_BATCH_LAYOUT = 2
SMALL_BATCH = 8


class StagedInputs:
    """Named int64 regions of one host buffer that reach the device with a single copy per step.

    A graph step's inputs (token ids, positions, slot mapping, context lengths, block tables, row indices) are
    written into numpy views of one pinned host buffer and sent with one asynchronous host-to-device copy,
    instead of one pageable copy per tensor (each a host sync and ~10-20 us of Python on a batch-1 step).

    Args:
        sizes: region name -> number of int64 elements.
        device: where the device copy lives (the host buffer is pinned when it is a CUDA device).
    """

    def __init__(self, sizes: dict[str, int], device: torch.device) -> None:
        self.regions: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, n in sizes.items():
            self.regions[name] = (offset, n)
            offset += n
        cuda = device.type == "cuda"
        self.host_buffer = torch.zeros(offset, dtype=torch.int64, pin_memory=cuda)
        self.device_buffer = torch.zeros(offset, dtype=torch.int64, device=device)
        self._host_np = self.host_buffer.numpy()
        # ``write_table_rows``' record of the block-table rows written (the host buffer keeps them)
        self.table_rows: list[tuple[list[int] | None, int]] = []
        self._sent = torch.cuda.Event() if cuda else None

    def host(self, name: str) -> np.ndarray:
        """Writable numpy view of a region (call ``wait_sent`` before the first write of a step)."""
        o, n = self.regions[name]
        return self._host_np[o : o + n]

    def on_device(self, name: str) -> torch.Tensor:
        """The device view of a region: stable storage, so a graph may capture it."""
        o, n = self.regions[name]
        return self.device_buffer[o : o + n]

    def wait_sent(self) -> None:
        """Block until the previous ``send`` has been read from host memory (normally long done)."""
        if self._sent is not None:
            self._sent.synchronize()

    def send(self) -> None:
        """Copy the whole host buffer to the device, ordered before later work on the current stream."""
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
        if self._sent is not None:
            self._sent.record()


def stage_decode_inputs(
    stage: StagedInputs,
    inp: ModelInput,
    q: int,
    batch_sizes: list[int],
    max_blocks: int,
    max_position: int,
) -> tuple[int, bool]:
    """Write ``inp`` into ``stage``'s host regions in a decode graph's padded layout: each sequence gets ``q``
    rows (shorter ones padded with dummy tokens: slot -1, positions after the last real one), the batch is
    padded up to the next captured size with dummy sequences (context length 0, every slot -1).

    Returns (graph batch size, whether the logits rows are exactly the first S rows, so no gather is needed).
    Regions written: input_ids, positions, slot_mapping [bs*q]; context_lens [bs]; block_tables rows [S];
    token_rows (q > 1) and logits_rows (unless direct).
    """
    S = len(inp.query_lens)
    bs = next(b for b in batch_sizes if b >= S)
    ids, pos, slots = stage.host("input_ids"), stage.host("positions"), stage.host("slot_mapping")
    ctx = stage.host("context_lens")
    m = S * q
    if q == 1:  # one token per sequence: the layout is the input's
        ids[:S], pos[:S], slots[:S] = inp.input_ids, inp.positions, inp.slot_mapping
        rows: np.ndarray | range | list[int] = range(S)
    elif S <= SMALL_BATCH_LAYOUT:  # a few sequences: lists (numpy's fixed costs are larger here)
        p_ids: list[int] = []
        p_pos: list[int] = []
        p_slots: list[int] = []
        rows = []
        r = 0
        for s, n in enumerate(inp.query_lens):
            p_ids += inp.input_ids[r : r + n] + [0] * (q - n)
            last = inp.positions[r + n - 1]
            p_pos += inp.positions[r : r + n] + [min(last + 1 + i, max_position) for i in range(q - n)]
            p_slots += inp.slot_mapping[r : r + n] + [-1] * (q - n)
            rows += range(s * q, s * q + n)
            r += n
        ids[:m], pos[:m], slots[:m] = p_ids, p_pos, p_slots
        stage.host("token_rows")[: len(rows)] = rows
    else:  # token t of sequence s goes to row s * q + (t - first token of s); as lists ~0.4 ms at S=64
        query_lens = np.asarray(inp.query_lens, dtype=np.int64)  # [S]
        ends = np.cumsum(query_lens)  # [S] exclusive end of each sequence's tokens
        firsts = ends - query_lens
        rows = np.repeat(np.arange(S, dtype=np.int64) * q - firsts, query_lens)  # [T] minus the token index
        rows += np.arange(len(rows), dtype=np.int64)
        positions = np.asarray(inp.positions, dtype=np.int64)  # [T]
        # pads continue after each sequence's last real position (capped), real rows overwritten below
        pad = positions[ends - 1, None] + 1 + (np.arange(q, dtype=np.int64)[None, :] - query_lens[:, None])
        pos[:m] = np.minimum(pad, max_position).reshape(-1)
        ids[:m], slots[:m] = 0, -1
        ids[rows], pos[rows], slots[rows] = inp.input_ids, positions, inp.slot_mapping
        stage.host("token_rows")[: len(rows)] = rows
    ctx[:S] = inp.context_lens
    write_table_rows(stage.host("block_tables").reshape(-1, max_blocks), stage.table_rows, inp.block_tables)
    if bs > S:  # dummy sequences: write nothing, read nothing
        ids[m : bs * q], pos[m : bs * q], slots[m : bs * q], ctx[S:bs] = 0, 0, -1, 0
    direct = q == 1 and len(inp.logits_indices) == S
    if not direct:
        stage.host("logits_rows")[: len(inp.logits_indices)] = np.asarray(rows)[inp.logits_indices]
    return bs, direct


def gather_prev_tokens(input_ids: torch.Tensor, rows: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """Async scheduling's device side: ``input_ids`` [T] int64 takes, in place, ``prev_tokens[rows[i]]`` (the
    previous launched step's sampled id [N'] int64) where ``rows[i] >= 0`` and keeps its own id where
    ``rows[i]`` is -1 (a prompt token, known on the host). ``rows`` [T] int64 on the same device
    (``ModelInput.prev_token_rows``)."""
    input_ids.copy_(torch.where(rows >= 0, prev_tokens[rows.clamp(min=0)], input_ids))


def write_table_rows(
    dest: np.ndarray, written: list[tuple[list[int] | None, int]], tables: list[list[int]]
) -> None:
    """Write ``tables[s]`` into row s of ``dest`` (a staged host buffer that keeps its contents between steps),
    skipping what an earlier call already wrote there. ``written`` records per row the list written last and
    how many of its entries; a row that holds the same list object again gets only its new entries. For block
    tables: a sequence's table only grows, and freeing its blocks gives it a new list (``BlockManager.free``,
    ``DraftKVCache.free``). Entries past a row's length may be stale (another sequence's): block tables are
    never read past a sequence's context. At batch 64 with ~40 blocks per sequence, rewriting every row cost
    ~70 us per step on a 2-core CPU, ~10 us this way."""
    if len(written) < len(tables):
        written.extend([(None, 0)] * (len(tables) - len(written)))
    for s, b in enumerate(tables):
        prev, n = written[s]
        k = len(b)
        if prev is not b:
            dest[s, :k] = b
        elif k > n:
            dest[s, n:k] = b[n:]
        else:
            continue
        written[s] = (b, k)
