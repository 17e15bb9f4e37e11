"""Shared fixtures. CPU by default; tests marked ``gpu`` run only where CUDA/ROCm is visible (the H200)."""

from __future__ import annotations

import gc
import json
import os
import re

import pytest
import torch

# Triton kernels run on CPU only under the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEFAULT_MODEL = "smollm2-135m-instruct"

# pytest-xdist (two workers: see README "Quick start"): the cores are split between the workers and the
# processes they start (CLI runs, servers), so two workers' OpenMP thread pools do not spin against each other
# on the same cores (two 2-thread processes on 2 cores ran ~5x slower each than alone; 1 thread each, ~1.5x).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)
RUN_THREADS = torch.get_num_threads()  # this process's intra-op threads for the run (``_keep_torch_threads``)


def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


_rss_after_collect = [0]


@pytest.fixture(autouse=True)
def _collect_dropped_engines():
    """An engine dropped by a test (model weights + KV cache, 1-2 GiB on CPU) sits in reference cycles, which
    only a full garbage collection frees, and large tensors never trigger one: two test workers kept ~20 GiB
    of dead engines between them. After a test that left this process >= 512 MiB larger than the last
    collection did, collect (~0.2 s)."""
    yield
    if os.path.exists("/proc/self/statm") and _rss_mib() - _rss_after_collect[0] >= 512:
        gc.collect()
        _rss_after_collect[0] = _rss_mib()


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it. Code under test may set it for its
    process (a Serve replica's ``cluster.server.build_engine``, a ``TPWorker``, a benchmark's
    ``--cpu-threads``); run in this process, that lasted for every later test: from
    tests/engine/test_gc_heap.py on, about half of the suite ran on one thread of the two (session 46: the
    whole suite 3,256 s on a 2-core AMD EPYC; ``tests/spec/test_exact_all_methods.py``'s DFlash case 55 s in
    the suite against 36-42 s alone)."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


# Packages whose tests run a local Ray cluster, Serve apps, HTTP servers, Prometheus or the CLI in subprocesses:
# ``serial`` (README's test command runs them after the two-worker part, in one process, as the whole suite used to
# run). Two workers would start two Ray clusters side by side, and these tests' deadlines and start-up waits were
# set with both cores free. Session 47 (2-core AMD EPYC, one run each): with these whole packages serial the suite
# took 1,206 + 791 s; with only the tests on the Ray cluster and the two modules starting Ray in a subprocess
# (148 tests), 1,401 + 727 s.
SERIAL_PACKAGES = ("actors", "cluster", "ops", "reliability")
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(trylast=True)  # after the plugins have registered their markers
def pytest_configure(config: pytest.Config) -> None:
    """A ``-m`` expression naming a marker that is not registered (pyproject.toml) is a usage error: a typo such
    as ``-m serail`` would otherwise deselect every test, and the run would end with "no tests ran"."""
    expr = config.getoption("markexpr", "") or ""
    registered = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    unknown = sorted(set(re.findall(r"[A-Za-z_]\w*", expr)) - {"and", "or", "not"} - registered)
    if unknown:
        raise pytest.UsageError(f"-m {expr!r}: unknown marker(s) {', '.join(unknown)}; registered: "
                                f"{', '.join(sorted(registered))}")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = os.path.relpath(str(item.path), _TESTS_DIR)
        if rel.split(os.sep, 1)[0] in SERIAL_PACKAGES and item.get_closest_marker("serial") is None:
            item.add_marker(pytest.mark.serial)
    # Under pytest-xdist, ``slow`` modules first (a stable sort): both workers start on the longest files and
    # the run ends on short ones, not on one long file with the other worker idle.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU; run on the H200 with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine():
    """One fp32 CPU engine for the default model, shared by tests that do not change its config."""
    from configs import EngineConfig
    from flexspec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cpu"))


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' own implementation of the same weights (the reference for exactness tests)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.executor.model_dir, dtype=torch.float32)
    return model.eval()


def random_tree(rng, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """A random draft tree of ``n`` nodes in topological order whose siblings hold distinct tokens of
    ``range(vocab)`` (``flexspec.spec.tree``'s contract): (parents, tokens). ``rng``: a ``random.Random``."""
    parents: list[int] = []
    tokens: list[int] = []
    used: set[tuple[int, int]] = set()
    for i in range(n):
        while True:
            p, t = rng.randint(-1, i - 1), rng.randrange(vocab)
            if (p, t) not in used:
                break
        used.add((p, t))
        parents.append(p)
        tokens.append(t)
    return parents, tokens


def real_prompts(engine, n_each: int = 7) -> list[list[int]]:
    """Token ids of real prompts: GSM8K + MT-Bench via the chat template, HumanEval raw."""
    from flexspec.datasets import load_prompts

    out = []
    for name in ("gsm8k", "humaneval", "mt_bench"):
        for p in load_prompts(name, limit=n_each):
            if p["chat"]:
                out.append(engine.apply_chat_template([{"role": "user", "content": p["prompt"]}]))
            else:
                out.append(engine.encode(p["prompt"]))
    return out


@pytest.fixture(scope="session")
def plain_128(engine, tmp_path_factory):
    """Plain greedy outputs (128 tokens) of the 21 real prompts of ``real_prompts(engine, n_each=7)``, in one
    continuous batch, computed once per test run (tests/engine checks their first 64 tokens against
    transformers; tests/spec, speculative decoding against them): pytest-xdist workers share them through a file
    in the run's own temp folder (under a lock), so only the first computes them (~1 min of one core)."""
    from filelock import FileLock

    from configs import SamplingParams

    prompts = real_prompts(engine, n_each=7)

    def decode() -> list[list[int]]:
        return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=128, temperature=0))]

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the parent of a lone run's temp folder outlives the run
        return prompts, decode()
    shared = tmp_path_factory.getbasetemp().parent / "plain_128.json"  # this run's, shared by its workers
    with FileLock(f"{shared}.lock"):
        if shared.is_file():
            saved = json.loads(shared.read_text())
            assert saved["prompts"] == prompts
            return prompts, saved["outputs"]
        ref = decode()
        shared.write_text(json.dumps({"prompts": prompts, "outputs": ref}))
    return prompts, ref


def plain_outputs(plain_128, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The shared engine's plain greedy outputs of ``prompts`` (each one of ``plain_128``'s 21) for ``max_tokens``
    <= 128, cut from ``plain_128`` instead of decoded again: greedy tokens depend neither on max_tokens (EOS
    stops both runs) nor, fp32 on the CPU, on the batch (tests/engine/test_generate_matches_hf.py: a batch of 8
    equals each prompt alone; tests/spec/test_exact_all_methods.py: speculative engines running 8 of them at a
    time reproduce ``plain_128``)."""
    assert max_tokens <= 128
    by_prompt = dict(zip(map(tuple, plain_128[0]), plain_128[1]))
    return [by_prompt[tuple(p)][:max_tokens] for p in prompts]


@pytest.fixture(scope="session")
def ray_session():
    """One fresh local 2-CPU Ray cluster per session, shared by tests/actors and tests/cluster.

    ``address="local"``: never attaches to a stale cluster left behind by ``ray stop``. Ray is imported here,
    not at module level, so CPU-only test runs without ``ray`` installed still import this conftest.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
