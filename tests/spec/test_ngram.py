"""n-gram (prompt lookup) speculation: exact at T=0, MAL > 2 on repetitive real text (issue 3)."""

from __future__ import annotations

import numpy as np

from configs import SamplingParams
from flexspec.spec.ngram import ngram_propose
from tests.spec.conftest import spec_engine


def test_ngram_propose_latest_longest_match():
    toks = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert ngram_propose(toks, 1, 3, 2) == [7, 5]  # latest earlier "1 2 3" is followed by 7 5
    assert ngram_propose(np.array([4, 5, 6]), 1, 3, 2) == []
    assert ngram_propose(toks, 1, 3, 0) == []


# T=0 exactness on the 21 real prompts x 128 tokens: tests/spec/test_exact_all_methods.py (case ngram); mixed
# with plain steps chosen by the policy: tests/spec/test_plain_steps_launched.py.


def test_ngram_mal_above_2_on_code_editing_prompt(engine):
    code = (
        "def total_price(items, tax_rate):\n"
        "    subtotal = 0\n"
        "    for item in items:\n"
        "        subtotal += item.price * item.quantity\n"
        "    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n"
    )
    ask = (
        "Rewrite this function exactly, but rename `subtotal` to `net_total`. Output only the code.\n\n"
        + code
    )
    ids = engine.apply_chat_template([{"role": "user", "content": ask}])
    eng = spec_engine(
        {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    )
    out = eng.generate([ids], SamplingParams(max_tokens=96, temperature=0))[0]
    ref = engine.generate([ids], SamplingParams(max_tokens=96, temperature=0))[0]
    assert out.token_ids == ref.token_ids
    assert eng.spec_metrics.mean_acceptance_length > 2.0, eng.spec_metrics.as_dict()
