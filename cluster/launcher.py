"""``flexspec serve``: start a local Ray cluster, deploy a Serve config file, block until SIGTERM / Ctrl-C.

The file is the same one ``serve deploy`` / ``serve run`` take (``applications: [{name, route_prefix,
import_path, args, deployments}]``); it is deployed the way ``serve run CONFIG`` does it, so ``deployments``
overrides apply too. Before anything starts, every application that uses ``cluster.app:build_app`` has its
``args`` validated with ``ServeArgs`` so a bad field fails at once, named (:class:`ServeConfigError`, one line).

Exit codes of :func:`serve_forever` (it serves until stopped): 128 + N after signal N (143 for SIGTERM, 130 for
Ctrl-C), as supervised servers report a stop by signal; 1 when the deployment failed, cannot be placed on the
cluster's nodes, or was not ready in time.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.readiness import BUILDER, app_demands, cluster_nodes, pending_report, summarize, unplaceable
from configs.serve import ServeArgs
from configs.speculative import parse_speculative_config
from flexspec.errors import validation_message

log = logging.getLogger(__name__)


class ServeConfigError(ValueError):
    """A Serve config file that cannot be used; the message is one line naming the field or the YAML position."""


def default_config_path() -> Path:
    """``configs/serve.yaml`` under the current directory, else the copy installed with the package."""
    local = Path("configs/serve.yaml")
    if local.is_file():
        return local
    import configs

    return Path(configs.__file__).parent / "serve.yaml"


def parse_speculative_override(text: str) -> dict[str, Any] | None:
    """The value of ``flexspec serve --speculative-config``: a JSON object with vLLM's field names (the format
    ``flexspec generate --speculative-config`` takes), or ``null`` for plain decoding.

    Returns:
        the object as given (validated as ``configs.speculative.SpeculativeConfig``), or None for ``null``.

    Raises:
        ServeConfigError: not JSON, not an object, or an invalid field, named
            (``--speculative-config.num_speculative_tokens: Input should be greater than or equal to 1``).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeConfigError(f"--speculative-config is not valid JSON: {e}") from e
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ServeConfigError(
            f"--speculative-config: expected a JSON object or null, got {type(value).__name__}"
        )
    try:
        parse_speculative_config(value)
    except ValidationError as e:
        raise ServeConfigError(validation_message(e, prefix="--speculative-config")) from e
    return value


def load_serve_config(
    path: Path, host: str | None = None, port: int | None = None, speculative_config: str | None = None
) -> Any:
    """Parse and validate a Serve config file; returns Ray's ``ServeDeploySchema``.

    Args:
        path: the Serve config file.
        host, port: override ``http_options`` when given.
        speculative_config: JSON of ``--speculative-config`` (:func:`parse_speculative_override`); when given it
            replaces the speculative config (top-level ``speculative_config`` and ``engine.speculative_config``)
            of every ``cluster.app:build_app`` application; ``"null"`` turns speculation off.

    Raises:
        ServeConfigError: unreadable file, invalid YAML (line and column), a wrong shape, an invalid field
            (named, e.g. ``applications.0.args.engine.max_model_len``), an invalid ``--speculative-config`` or a
            port outside 1-65535.
    """
    override = parse_speculative_override(speculative_config) if speculative_config is not None else None
    from ray.serve.schema import ServeDeploySchema

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ServeConfigError(f"cannot read the file: {e}") from e
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ServeConfigError(_yaml_message(e)) from e
    if not isinstance(raw, dict):
        raise ServeConfigError(f"expected a mapping with 'applications' at the top, got {type(raw).__name__}")
    apps = raw.get("applications")
    if apps is not None and not isinstance(apps, list):
        raise ServeConfigError(f"applications: expected a list, got {type(apps).__name__}")
    for i, app in enumerate(apps or []):
        if not isinstance(app, dict):
            raise ServeConfigError(f"applications.{i}: expected a mapping, got {type(app).__name__}")
        if app.get("import_path") == BUILDER:
            if speculative_config is not None:
                app["args"] = _with_speculative_config(app.get("args"), override, i)
            try:
                ServeArgs.model_validate(app.get("args") or {})
            except ValidationError as e:
                named = (
                    {"speculative_config": "--speculative-config"} if speculative_config is not None else None
                )
                raise ServeConfigError(validation_message(e, f"applications.{i}.args", named)) from e
    if host is not None or port is not None:
        http = raw.get("http_options") or {}
        if not isinstance(http, dict):
            raise ServeConfigError(f"http_options: expected a mapping, got {type(http).__name__}")
        raw["http_options"] = http | ({"host": host} if host else {}) | ({"port": port} if port else {})
    try:
        config = ServeDeploySchema.model_validate(raw)
    except ValidationError as e:
        raise ServeConfigError(validation_message(e)) from e
    unknown = _unknown_keys(raw, ServeDeploySchema, "")
    for key in ("http_options", "grpc_options"):
        if isinstance(raw.get(key), dict):
            unknown += _unknown_keys(raw[key], type(getattr(config, key)), f"{key}.")
    for i, (app, parsed) in enumerate(zip(apps or [], config.applications)):
        unknown += _unknown_keys(app, type(parsed), f"applications.{i}.")
        for j, (dep, dep_parsed) in enumerate(zip(app.get("deployments") or [], parsed.deployments)):
            if isinstance(dep, dict):
                unknown += _unknown_keys(dep, type(dep_parsed), f"applications.{i}.deployments.{j}.")
    if unknown:  # Serve's schemas ignore them: a typo (``prot: 8001``) would silently fall back to a default
        raise ServeConfigError(f"{unknown[0]}: unknown field (not in Ray Serve's config schema)")
    if not 1 <= config.http_options.port <= 65535:
        raise ServeConfigError(f"http_options.port: {config.http_options.port} is not a TCP port (1-65535)")
    return config


def _unknown_keys(raw: dict[str, Any], schema: Any, where: str) -> list[str]:
    """Keys of ``raw`` that are neither a field nor an alias of the pydantic model ``schema``."""
    fields = schema.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    return [f"{where}{k}" for k in raw if k not in known]


def _with_speculative_config(args: Any, spec: dict[str, Any] | None, index: int) -> dict[str, Any]:
    """``args`` of application ``index`` with its speculative config replaced by ``spec`` (None: none)."""
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ServeConfigError(f"applications.{index}.args: expected a mapping, got {type(args).__name__}")
    args = {k: v for k, v in args.items() if k != "speculative_config"}
    engine = args.get("engine")
    if isinstance(engine, dict):  # anything else fails validation below, named
        args["engine"] = {k: v for k, v in engine.items() if k != "speculative_config"}
    if spec is not None:
        args["speculative_config"] = spec
    return args


def _yaml_message(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"invalid YAML{where}: {problem}"


def local_model_problems(config: Any, speculative_field: str | None = None) -> list[str]:
    """Models of ``build_app`` applications that are neither built in nor an existing path on this machine, one
    line each naming the field (``applications.0.args.model: unknown model 'x': ...``). ``speculative_field``
    names the drafter's field instead (e.g. ``--speculative-config``) when the command line set it.

    Only meaningful where the replicas run on this machine (the local cluster of ``flexspec serve``); on a remote
    cluster a path may exist only there.
    """
    from flexspec.models.registry import unknown_model_problem

    problems = []
    for i, app in enumerate(config.applications):
        if app.import_path != BUILDER:
            continue
        given = app.args or {}
        args = ServeArgs.model_validate(given)
        where = f"applications.{i}.args" + ("" if "model" in given else ".engine")
        checks = [(f"{where}.model", args.engine.model, False)]
        spec = args.engine.speculative_config
        if spec is not None and getattr(spec, "model", None):
            where = f"applications.{i}.args" + ("" if "speculative_config" in given else ".engine")
            field = f"{speculative_field or where + '.speculative_config'}.model"
            checks.append((field, spec.model, True))
        unknown = [
            f"{field}: {why}"
            for field, model, drafter in checks
            if (why := unknown_model_problem(model, drafter)) is not None
        ]
        problems += unknown or _context_problems(args, checks[0][0], f"applications.{i}.args.engine")
    return problems


def _context_problems(args: ServeArgs, model_field: str, where: str) -> list[str]:
    """``max_model_len`` past the target's ``max_position_embeddings`` (what the replica's engine would refuse
    after Ray started); reads the model's config.json (a built-in GGUF model is converted and cached first)."""
    from flexspec.errors import FlexspecError
    from flexspec.models.loader import load_config, resolve_model_dir
    from flexspec.models.spec import ModelSpec

    try:
        spec = ModelSpec.from_hf(load_config(resolve_model_dir(args.engine.model)))
    except FlexspecError as e:
        return [f"{model_field}: {e.message}"]
    except (KeyError, ValueError, TypeError) as e:  # a config.json without a field the model needs
        return [f"{model_field}: the model's config.json cannot be read as a supported model: {e!r}"]
    problem = spec.context_problem(args.engine.max_model_len)  # the engine's own check (ModelRunner)
    return [] if problem is None else [f"{where}.max_model_len: {problem}"]


def serve_forever(
    path: Path,
    address: str | None = None,
    num_cpus: int | None = None,
    host: str | None = None,
    port: int | None = None,
    ready_timeout_s: float = 1800.0,
    grace_s: float = 15.0,
    speculative_config: str | None = None,
) -> int:
    """Deploy ``path`` and block until SIGTERM/SIGINT; then shut Serve and Ray down. Returns an exit code (module
    docstring).

    ``address=None`` starts a new local Ray cluster (``address="local"``: never attaches to a stale
    ``ray_current_cluster`` left by ``ray stop``); ``address="auto"`` attaches to a running one. A replica that no
    node of a local cluster can hold fails at once, naming what is missing; on an attached cluster (which an
    autoscaler may grow) it is reported after ``grace_s`` and waited for up to ``ready_timeout_s``.
    ``speculative_config`` (JSON) replaces the file's speculative config, as in :func:`load_serve_config`.
    """
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions

    config = load_serve_config(path, host, port, speculative_config)
    stop = threading.Event()
    received: list[int] = []

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        received.append(signum)
        stop.set()

    def stopped_code() -> int:
        return 128 + received[0]

    try:
        ray.init(
            address=address or "local", namespace="serve", num_cpus=num_cpus if address is None else None
        )
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError...: Ray's wording says why
        return _error(f"cannot start or reach Ray (address {address or 'local'!r}): {summarize(str(e))}")
    # After ray.init: Ray's core worker installs a SIGTERM handler that kills the process mid-shutdown.
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    serve_started = False
    try:
        can_grow = address is not None
        problems = unplaceable(app_demands(config), cluster_nodes())
        if problems and not can_grow:
            return _error("cannot place the deployment on this local Ray cluster: " + "; ".join(problems))
        if problems:
            print("flexspec: waiting for the cluster to grow: " + "; ".join(problems), flush=True)
        # What `serve run CONFIG` does: start Serve with the file's proxy/HTTP options, then deploy its apps.
        try:
            client = serve_api.serve_start(
                http_options=config.http_options.model_dump(),
                proxy_location=config.proxy_location,
                grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
                controller_options=config.controller_options,
            )
            serve_started = True
            client.deploy_apps(config, _blocking=False)
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken, the host is not this machine's
            return _error(f"Ray Serve could not start: {summarize(str(e))}")
        names = [a.name for a in config.applications]
        code = _wait_ready(names, stop, ready_timeout_s, can_grow=can_grow, grace_s=grace_s)
        if received:
            return stopped_code()
        if code == 0:
            url = f"http://{config.http_options.host}:{config.http_options.port}"
            print(
                f"flexspec: serving {', '.join(names)} at {url} (OpenAI API under /v1); SIGTERM or Ctrl-C stops",
                flush=True,
            )
            stop.wait()
            return stopped_code()
        return code
    finally:
        try:
            if serve_started:
                serve.shutdown()
        finally:
            ray.shutdown()
            for s, h in previous.items():
                signal.signal(s, h)


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def _wait_ready(
    names: list[str],
    stop: threading.Event,
    timeout_s: float,
    can_grow: bool = False,
    grace_s: float = 15.0,
    report_every_s: float = 60.0,
) -> int:
    """0 once every app of ``names`` is RUNNING (or on ``stop``), 1 when one failed, cannot be placed (after
    ``grace_s``, unless ``can_grow``) or is not ready after ``timeout_s``. What it waits for is printed after
    ``grace_s`` and again whenever it changes (at most every ``report_every_s``)."""
    from ray import serve

    start = time.monotonic()
    last_report: list[str] = []
    last_print = -float("inf")
    while not stop.is_set():
        apps = serve.status().applications
        states = {n: apps[n] for n in names if n in apps}
        failed = [_failure(n, s) for n, s in states.items() if str(s.status).endswith("DEPLOY_FAILED")]
        if failed:
            return _error("deployment failed: " + "; ".join(failed))
        if len(states) == len(names) and all(str(s.status).endswith("RUNNING") for s in states.values()):
            return 0
        elapsed = time.monotonic() - start
        if elapsed >= grace_s or elapsed > timeout_s:
            stuck, waiting = pending_report(names, apps)
            if stuck and not can_grow:
                return _error("cannot place the deployment on this Ray cluster: " + "; ".join(stuck))
            if elapsed > timeout_s:
                states_line = [f"{n}: {str(s.status).rsplit('.', 1)[-1]}" for n, s in states.items()]
                return _error(
                    f"not ready after {timeout_s:.0f}s: " + "; ".join(states_line + stuck + waiting)
                )
            report = stuck + waiting
            if report and report != last_report and elapsed - last_print >= report_every_s:
                print(f"flexspec: not ready after {elapsed:.0f}s: " + "; ".join(report), flush=True)
                last_report, last_print = report, elapsed
        stop.wait(1.0)
    return 0


def _failure(name: str, status: Any) -> str:
    """``app: message`` of a failed app, with its failed deployments' own messages (the app's says only which)."""
    parts = [summarize(status.message)] + [
        f"{dep_name}: {summarize(dep.message)}"
        for dep_name, dep in (status.deployments or {}).items()
        if not str(dep.status).endswith("HEALTHY") and dep.message
    ]
    return f"{name}: " + " ".join(p for p in parts if p)
