"""``flexspec serve`` end to end: own local Ray cluster, the default config, one request, SIGTERM exits 143 after a
clean shutdown; a config whose replica no node can hold fails at once, naming what is missing."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import yaml

from configs import SamplingParams
from tests.cluster.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_flexspec_serve_default_config_and_sigterm(engine):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "flexspec.cli",
        "serve",
        "--config",
        "configs/serve.yaml",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-cpus",
        "2",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"RAY_DEDUP_LOGS": "0"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("flexspec: serving" in x for x in seen):
            assert proc.poll() is None, "".join(seen[-30:])
            assert time.monotonic() < deadline, "not ready:\n" + "".join(seen[-30:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass

        question = "What is the capital of France?"
        ids = engine.apply_chat_template([{"role": "user", "content": question}])
        ref = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=16,
        )
        assert r.choices[0].message.content == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 128 + signal.SIGTERM, "".join(seen[-30:])  # 143, as supervised servers report SIGTERM


def test_flexspec_serve_fails_fast_when_no_node_can_hold_a_replica(tmp_path):
    """A replica asking for more CPUs than the local cluster has used to wait 30 minutes in silence."""
    config = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    config["applications"][0]["args"]["cpus_per_worker"] = 64
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "flexspec.cli", "serve", "--config", str(path), "--port", str(free_port()),
           "--num-cpus", "2"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 180
    assert (
        "error: cannot place the deployment on this local Ray cluster: applications.0 (flexspec): LLMServer "
        "replica needs CPU 64 on one node; the best node lacks CPU 62"
    ) in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_flexspec_serve_fails_at_once_on_a_port_in_use(tmp_path):
    """A taken port used to start Ray, then fail with Ray's traceback when the proxy could not bind; a host
    that is not this machine's is named as the host's fault."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
        config["http_options"] = {"host": "127.0.0.1", "port": port}
        path = tmp_path / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        runs = {
            "--port": ["--config", "configs/serve.yaml", "--host", "127.0.0.1", "--port", str(port)],
            f"{path}: http_options.port": ["--config", str(path)],
        }
        for field, args in runs.items():
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "flexspec.cli", "serve", *args], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
            assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
            assert time.monotonic() - t0 < 60  # no Ray cluster was started
            assert proc.stderr.strip() == (
                f"error: {field}: 127.0.0.1:{port} is already in use (Address already in use); stop that server "
                "or pick another port"
            ), proc.stderr

        proc = subprocess.run([sys.executable, "-m", "flexspec.cli", "serve", "--config", "configs/serve.yaml",
                               "--host", "no-such-host.invalid", "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.startswith("error: --host: 'no-such-host.invalid' does not resolve ("), proc.stderr
