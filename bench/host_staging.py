"""Host time of staging a step's inputs for the CUDA graphs: the decode / verification graph layout
(``flexspec.engine.graph_inputs.stage_decode_inputs``) and a fused verification tail's rows
(``flexspec.spec.fused_step.stage_tail_rows``), per step, at each batch size.

    python -m bench.host_staging --batch-sizes 1,8,64 --steps 2000 --output host_staging.json

This is host Python and numpy only (the buffers are CPU tensors here; on a GPU they are pinned and sent in one
copy), so it runs anywhere and is a CPU regression number, not a GPU claim. Each batch is decoding: sequences
with ``--context`` cached tokens whose block tables (16-token blocks) grow as their contexts advance by 1-4
tokens a step, so most steps find a sequence's table unchanged (a sequence reaching ``--max-model-len`` is
replaced by a new one). Plain steps stage one token per sequence;
verification steps stage ``1 + d`` tokens per sequence (d uniform in 1 .. ``--drafts``) into graphs of
``1 + --drafts`` rows per sequence, then the fused tail's rows (meta, drafter block table, drafts).
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import JsonReport, environment, int_list, log, output_path, positive_int

BLOCK_SIZE = 16


class _Batch:
    """S decoding sequences: contexts, target and drafter block tables (live lists that grow)."""

    def __init__(self, rng: random.Random, num_seqs: int, context: int) -> None:
        self.rng = rng
        self.start = context
        self.ctx = [context + rng.randrange(64) for _ in range(num_seqs)]
        self.next_block = 0
        self.tables = [self._blocks(c + 1) for c in self.ctx]
        self.drafter_tables = [self._blocks(c + 1) for c in self.ctx]

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def advance(self, room: int, max_len: int) -> None:
        """Every sequence's context grows by 1-4 tokens; tables grow to hold ``room`` more. A sequence that would
        pass ``max_len`` is replaced by a new one (new tables, context back to the start)."""
        for s in range(len(self.ctx)):
            self.ctx[s] += self.rng.randint(1, 4)
            if self.ctx[s] + room > max_len:
                self.ctx[s] = self.start + self.rng.randrange(64)
                self.tables[s] = self._blocks(self.ctx[s] + 1)
                self.drafter_tables[s] = self._blocks(self.ctx[s] + 1)
            for t in (self.tables[s], self.drafter_tables[s]):
                while len(t) * BLOCK_SIZE < self.ctx[s] + room:
                    t.append(self.next_block)
                    self.next_block += 1

    def model_input(self, drafts: int):
        from flexspec.engine.model_input import ModelInput

        ids, pos, slots, query_lens = [], [], [], []
        for s, c in enumerate(self.ctx):
            n = 1 + (self.rng.randint(1, drafts) if drafts else 0)
            query_lens.append(n)
            for p in range(c, c + n):
                ids.append(self.rng.randrange(49152))
                pos.append(p)
                slots.append(self.tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        logits = list(range(len(ids)))
        inp = ModelInput(ids, pos, slots, self.tables, list(self.ctx), query_lens, logits)
        inp.num_draft_tokens = [n - 1 for n in query_lens]
        return inp


def measure(num_seqs: int, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np
    import torch

    from flexspec.engine.graph_inputs import StagedInputs, stage_decode_inputs
    from flexspec.spec.dflash_device import META_COLS
    from flexspec.spec.fused_step import stage_tail_rows

    rng = random.Random(0)
    max_blocks = -(-args.max_model_len // BLOCK_SIZE)
    result: dict[str, float] = {}
    for name, drafts in (("plain", 0), ("verify", args.drafts)):
        q = 1 + drafts
        n = num_seqs * q
        sizes = {"input_ids": n, "positions": n, "slot_mapping": n, "context_lens": num_seqs,
                 "block_tables": num_seqs * max_blocks, "logits_rows": n, "token_rows": n}  # fmt: skip
        stage = StagedInputs(sizes, torch.device("cpu"))
        meta_width = META_COLS + max_blocks
        tail = np.zeros((num_seqs, meta_width + drafts), dtype=np.int64)
        tail_record: list = []
        batch = _Batch(rng, num_seqs, args.context)
        graph_s = tail_s = 0.0
        for step in range(args.warmup + args.steps):
            batch.advance(q, args.max_model_len)
            inp = batch.model_input(drafts)
            meta = [[c, ql, 0, 1, ql - 1, 1, 1 << 20] for c, ql in zip(inp.context_lens, inp.query_lens)]
            t0 = time.perf_counter()
            stage_decode_inputs(stage, inp, q, [num_seqs], max_blocks, args.max_model_len)
            t1 = time.perf_counter()
            if drafts:
                stage_tail_rows(tail, tail_record, inp, meta, batch.drafter_tables, meta_width, num_seqs)
            t2 = time.perf_counter()
            if step >= args.warmup:
                graph_s += t1 - t0
                tail_s += t2 - t1
        result[f"{name}_graph_inputs_us"] = round(graph_s / args.steps * 1e6, 2)
        if drafts:
            result[f"{name}_fused_tail_rows_us"] = round(tail_s / args.steps * 1e6, 2)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Reports mean microseconds per step (JSON with --output).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 8, 64], help="Sequences per step.")
    ap.add_argument("--steps", type=positive_int, default=2000, help="Timed steps per batch size.")
    ap.add_argument("--warmup", type=int, default=50, help="Untimed steps first.")
    ap.add_argument(
        "--context", type=positive_int, default=300, help="Cached tokens per sequence at the start."
    )
    ap.add_argument(
        "--drafts", type=positive_int, default=15, help="Drafts K (verification graphs of 1 + K rows)."
    )
    ap.add_argument("--max-model-len", type=positive_int, default=2048, help="Sets the block-table width.")
    ap.add_argument("--output", type=output_path, default=None, help="JSON file (none: printed only).")
    args = ap.parse_args(argv)
    report = JsonReport(
        args.output,
        {"schema": "flexspec.bench.host_staging/1", "env": environment(), "config": vars(args), "points": []},
    )
    for b in args.batch_sizes:
        point = {"batch_size": b, **measure(b, args)}
        log(str(point))
        report.doc["points"].append(point)
        report.save()


if __name__ == "__main__":
    main()
