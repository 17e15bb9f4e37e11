"""``flexspec serve``: start a local Ray cluster, deploy a Serve config file, block until SIGTERM / Ctrl-C.

The file is the same one ``serve deploy`` / ``serve run`` take (``applications: [{name, route_prefix,
import_path, args, deployments}]``); it is deployed the way ``serve run CONFIG`` does it, so ``deployments``
overrides apply too. Before anything starts, every application that uses ``cluster.app:build_app`` has its
``args`` validated with ``ServeArgs`` so a bad field fails at once, named.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from configs.serve import ServeArgs

log = logging.getLogger(__name__)

BUILDER = "cluster.app:build_app"


def validation_message(e: ValidationError, prefix: str = "") -> str:
    """One line per error: ``applications.0.args.engine.max_num_seqs: Input should be greater than 0``."""
    lines = []
    for err in e.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(x) for x in err["loc"]])
        lines.append(f"{loc}: {err['msg']}")
    return "; ".join(lines)


def default_config_path() -> Path:
    """``configs/serve.yaml`` under the current directory, else the copy installed with the package."""
    local = Path("configs/serve.yaml")
    if local.is_file():
        return local
    import configs

    return Path(configs.__file__).parent / "serve.yaml"


def load_serve_config(path: Path, host: str | None = None, port: int | None = None) -> Any:
    """Parse and validate a Serve config file; returns Ray's ``ServeDeploySchema``.

    Raises:
        FileNotFoundError, yaml.YAMLError, pydantic.ValidationError (field named, e.g.
        ``applications.0.args.engine.max_model_len``).
    """
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text()) or {}
    for i, app in enumerate(raw.get("applications") or []):
        if app.get("import_path") == BUILDER:
            try:
                ServeArgs.model_validate(app.get("args") or {})
            except ValidationError as e:
                raise ValueError(validation_message(e, prefix=f"applications.{i}.args")) from e
    if host is not None or port is not None:
        http = raw.setdefault("http_options", {}) or {}
        raw["http_options"] = http | ({"host": host} if host else {}) | ({"port": port} if port else {})
    return ServeDeploySchema.model_validate(raw)


def serve_forever(
    path: Path,
    address: str | None = None,
    num_cpus: int | None = None,
    host: str | None = None,
    port: int | None = None,
    ready_timeout_s: float = 1800.0,
) -> int:
    """Deploy ``path`` and block until SIGTERM/SIGINT; then shut Serve and Ray down. Returns an exit code.

    ``address=None`` starts a new local Ray cluster (``address="local"``: never attaches to a stale
    ``ray_current_cluster`` left by ``ray stop``); ``address="auto"`` attaches to a running one.
    """
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions

    config = load_serve_config(path, host, port)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    ray.init(address=address or "local", namespace="serve", num_cpus=num_cpus if address is None else None)
    # After ray.init: Ray's core worker installs a SIGTERM handler that kills the process mid-shutdown.
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # What `serve run CONFIG` does: start Serve with the file's proxy/HTTP options, then deploy its apps.
        client = serve_api.serve_start(
            http_options=config.http_options.model_dump(),
            proxy_location=config.proxy_location,
            grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
            controller_options=config.controller_options,
        )
        client.deploy_apps(config, _blocking=False)
        names = [a.name for a in config.applications]
        code = _wait_ready(names, stop, ready_timeout_s)
        if code == 0:
            url = f"http://{config.http_options.host}:{config.http_options.port}"
            print(
                f"flexspec: serving {', '.join(names)} at {url} (OpenAI API under /v1); SIGTERM or Ctrl-C stops",
                flush=True,
            )
            stop.wait()
        return code
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for s, h in previous.items():
                signal.signal(s, h)


def _wait_ready(names: list[str], stop: threading.Event, timeout_s: float) -> int:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        apps = serve.status().applications
        states = {n: apps[n] for n in names if n in apps}
        failed = [f"{n}: {s.message}" for n, s in states.items() if str(s.status).endswith("DEPLOY_FAILED")]
        if failed:
            print("flexspec: deployment failed:\n" + "\n".join(failed), flush=True)
            return 1
        if len(states) == len(names) and all(str(s.status).endswith("RUNNING") for s in states.values()):
            return 0
        if time.monotonic() > deadline:
            print(f"flexspec: not ready after {timeout_s:.0f}s", flush=True)
            return 1
        stop.wait(1.0)
    return 0
