"""Draft-tree acceptance replayed over traces (bench.tree_replay) and the ranks it reads (acceptance_trace
--top-r), against brute force and the real DFlash drafter."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.acceptance_trace import collect
from bench.tree_replay import fit_static_tree, leading, replay
from bench.tree_replay import main as tree_main
from tests.spec.conftest import spec_engine


def test_static_tree_is_the_most_frequent_prefixes():
    traces = [
        {"ranks": [None, [0, 0, 1], [1, 0, 8], [0, 2], [0, 0, 0]]},
        {"ranks": [None, [8, 0], [0, 1, 0]]},
    ]
    tree = fit_static_tree(traces, 4, top_r=8)
    # prefix counts: (0,) 5, (0,0) 3, (0,0,1) 1, (0,0,0) 1, (1,) 1, (1,0) 1, (0,2) 1, (0,1) 1, (0,1,0) 1
    assert tree[:2] == [(0,), (0, 0)] and len(tree) == 4
    assert all(p[:-1] in tree for p in tree if len(p) > 1)
    assert all(8 not in p for p in fit_static_tree(traces, 100, top_r=8))  # rank R = not among the top R


def test_leading_and_replay_walk_a_request_like_decoding():
    assert leading([0, 0, 3, 0]) == 2 and leading([1, 0]) == 0 and leading([]) == 0
    assert leading([0, 1, 0], {(0,), (0, 1), (0, 1, 0)}) == 3 and leading([1], {(0,)}) == 0
    trace = {"ranks": [None, [0, 0, 5], [0], [1, 0], [0, 0], [0]]}
    # from L=1: accepts 2 (tokens 1-3), then L=4: accepts min(2, 6-4-1) = 1 (tokens 4-5): 2 steps, 5 tokens
    assert replay(trace, lambda L: leading(trace["ranks"][L])) == (2, 5)
    ends = {"ranks": [None, [0], [1], None]}  # the last token had nothing left to draft for: a one-token step
    assert replay(ends, lambda L: leading(ends["ranks"][L])) == (2, 3)


def test_ranks_describe_the_real_drafters_blocks(engine):
    """With selective verification off, every verification accepts exactly the leading rank-0 run of its rank
    row (where the block had all k drafts), and a tree replay's chain equals the trace's own acceptance."""
    from tests.conftest import real_prompts

    prompts = real_prompts(engine, n_each=1)[:2]
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 6}
    eng = spec_engine(
        {**spec, "execution": "decoupled", "device_verification": False, "verification_threshold": 0}
    )
    traces = collect(eng, prompts, max_tokens=24, batch_size=2, top_r=4)
    checked = 0
    for t in traces:
        n = t["num_output_tokens"]
        for L, (acc, row, probs) in enumerate(zip(t["accepted"], t["ranks"], t["probs"])):
            if acc is None:
                assert row is None and probs is None
                continue
            assert len(row) == len(probs) <= min(6, n - L) and all(0 <= r <= 4 for r in row)
            assert all(p == sorted(p, reverse=True) and len(p) == 4 for p in probs)
            if L + 6 < n - 1:  # the block had all k drafts (near the end they are cut to max_tokens)
                assert len(row) == 6 and leading(row) == acc, (L, row, acc)
                checked += 1
        chain = replay(t, t["accepted"].__getitem__)
        assert chain == replay(t, lambda L, t=t: min(leading(t["ranks"][L]), t["accepted"][L]))
    assert checked >= 20


def test_main_reports_every_tree_and_rejects_traces_without_ranks(tmp_path, capsys):
    rows = [None] + [[0, 1, 0, 8]] * 30
    probs = [None] + [[[0.7, 0.2], [0.5, 0.4], [0.9, 0.05], [0.6, 0.1]]] * 30
    trace = {"ranks": rows, "probs": probs, "accepted": [None] + [1] * 30, "num_output_tokens": 31}
    doc = {
        "schema": "flexspec.bench.acceptance_trace/1",
        "config": {"top_r": 2},
        "num_speculative_tokens": 4,
        "traces": {"gsm8k": [trace] * 4},
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    out = tree_main([str(path), "--budgets", "3,5", "--output", str(tmp_path / "r.json")])
    trees = out["datasets"]["gsm8k"]["trees"]
    assert trees["chain (k=4, as verified)"]["mal"] == 2.0 and trees["chain_all (k=4)"]["mal"] == 2.0
    # static N=3 (fit on the first 2 requests) = {(0,), (0,1), (0,1,0)}: 3 drafts accepted per step from
    # L=1, 5, ..., 25, then 1 at L=29 (the output's end): 30 tokens in 8 steps
    assert out["static_trees"]["3"] == [[0], [0, 1], [0, 1, 0]] and trees["static (N=3)"]["mal"] == 3.75
    # dynamic by products: N=3 = (0,) .7, (0,0) .35, (0,0,0) .315: accepts 1; N=5 adds (0,1) .28, (0,1,0) .252
    assert trees["dynamic (N=3)"]["mal"] == 2.0 and trees["dynamic (N=5)"]["mal"] == 3.75
    assert json.loads((tmp_path / "r.json").read_text())["schema"] == "flexspec.bench.tree_replay/1"
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert tree_main([str(gz), "--budgets", "3,5"])["datasets"] == out["datasets"]
    doc["traces"]["gsm8k"] = [{k: v for k, v in trace.items() if k != "ranks"}] * 4
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        tree_main([str(path)])
    assert e.value.code == 2 and "record it with --top-r" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-r", "100"], "--top-r: expected 0 (off) or 1..64"),
        (["--top-r", "-1"], "--top-r: expected 0 (off) or 1..64"),
        (["--top-r", "4", "--speculative-config", '{"method": "ngram"}'], "needs method 'dflash'"),
    ],
)
def test_top_r_is_checked_before_the_engine_loads(args, message, tmp_path, capsys):
    from bench.acceptance_trace import main as trace_main

    spec = ["--speculative-config", '{"method": "dflash", "model": "smollm2-135m-instruct-dflash"}']
    with pytest.raises(SystemExit) as e:
        trace_main([*spec, "--output", str(tmp_path / "t.json"), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "not an acceptance trace"),
        ({"schema": "flexspec.bench.acceptance_trace/1", "config": None}, "tree_replay: error"),
        (
            {
                "schema": "flexspec.bench.acceptance_trace/1",
                "config": {"top_r": 2},
                "num_speculative_tokens": 2,
                "traces": {
                    "gsm8k": [{"ranks": [None, [0]], "probs": [None, [[0.9, 0.1]]], "accepted": [None, 1]}]
                },
            },
            "needs at least 2 requests",
        ),
    ],
)
def test_malformed_traces_are_usage_errors(doc, message, tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        tree_main([str(path)])
    assert e.value.code == 2 and message in capsys.readouterr().err
