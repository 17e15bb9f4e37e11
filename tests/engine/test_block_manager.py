"""Block allocation order: free blocks are a stack, so the blocks ever written stay those of the peak number in
use (a CPU KV cache's pages are committed as first written); and the engine's tokens do not depend on it."""

from __future__ import annotations

from configs import SamplingParams
from flexspec.engine.block_manager import BlockManager
from flexspec.engine.sequence import Sequence


def _seq(num_tokens: int) -> Sequence:
    return Sequence(
        "r",
        list(range(num_tokens)),
        SamplingParams(max_tokens=1),
        seed=0,
        max_model_len=None,
        eos_token_ids=(),
    )


def test_freed_blocks_are_handed_out_first_in_their_order():
    bm = BlockManager(num_blocks=100, block_size=16)
    a, b = _seq(40), _seq(20)
    bm.allocate(a, 40)
    bm.allocate(b, 20)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]  # a fresh cache from block 0 up
    bm.free(a)
    c = _seq(70)
    bm.allocate(c, 70)
    assert c.block_table == [0, 1, 2, 5, 6]  # a's blocks first, in their order, then fresh ones
    bm.allocate(c, 90)  # growing takes the next free block
    assert c.block_table[-1] == 7 and bm.num_free_blocks == 100 - 8


def test_blocks_written_stay_those_of_the_peak_in_use():
    """Many sequences, at most four at a time: only the blocks of the peak are ever touched (a queue would
    cycle through the whole cache)."""
    bm = BlockManager(num_blocks=1000, block_size=16)
    live: list[Sequence] = []
    used: set[int] = set()
    peak = 0
    for i in range(200):
        s = _seq(16 * (1 + i % 5))
        bm.allocate(s, len(s.token_ids))
        used.update(s.block_table)
        live.append(s)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        if len(live) == 4:
            bm.free(live.pop(i % 4))
    assert len(used) == peak <= 4 * 5


def test_engine_reuses_the_same_blocks_request_after_request(engine):
    """The shared engine, requests one after another: each starts on the blocks its predecessor freed."""
    tables = []
    allocate = engine.block_manager.allocate

    def spy(seq, num_tokens):
        allocate(seq, num_tokens)
        tables.append(list(seq.block_table))

    engine.block_manager.allocate = spy
    try:
        prompt = engine.tokenizer.encode("The capital of France is")
        outs = [engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0] for _ in range(3)]
    finally:
        del engine.block_manager.allocate
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    firsts = {t[0] for t in tables}
    assert len(firsts) == 1, tables  # every request's first block is the one freed by the one before
