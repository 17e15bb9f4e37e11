"""TP=2 through Serve: the replica sits in bundle 0 of its STRICT_PACK placement group, one TPWorker per bundle."""

from __future__ import annotations

import openai
import pytest

from configs import SamplingParams
from tests.cluster.conftest import APP_ARGS, MODEL_NAME, deploy


@pytest.fixture(scope="module")
def tp2_server(ray_session):
    from ray import serve

    args = APP_ARGS | {"tensor_parallel_size": 2, "cpus_per_worker": 1}
    yield deploy(args, "flexspec-tp2", MODEL_NAME)
    serve.shutdown()


def test_tp2_replica_answers_like_tp1_engine(tp2_server, engine, ray_session):
    question = "Write a haiku about the sea."
    ids = engine.apply_chat_template([{"role": "user", "content": question}])
    ref = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))[0]
    client = openai.OpenAI(base_url=tp2_server.api, api_key="unused", max_retries=0, timeout=120)
    chunks = list(
        client.chat.completions.create(
            model=tp2_server.model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert tp2_server.llm_handle().spec_decode_metrics.remote().result()["num_drafts"] > 0  # it speculated

    groups = [
        g
        for g in ray_session.util.placement_group_table().values()
        if g["state"] == "CREATED" and "LLMServer" in g["name"]
    ]
    assert len(groups) == 1
    assert groups[0]["strategy"] == "STRICT_PACK"
    assert list(groups[0]["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
