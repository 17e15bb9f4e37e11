"""``flexspec`` command line (typer)."""

from __future__ import annotations

import json
import sys
import time

import typer
from pydantic import ValidationError

from flexspec.errors import FlexspecError, check_context_length, validation_message

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="flexspec: LLM serving with speculative decoding"
)


@app.callback()
def main() -> None:
    """flexspec: LLM serving on Ray with lossless speculative decoding."""


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _listen_problem(host: str, port: int) -> tuple[str, str] | None:
    """Why a TCP server could not listen on ``host:port`` on this machine, as (the field at fault, "host" or
    "port"; the reason): a port in use or privileged, a host that does not resolve or is not this machine's.
    None if it can. Binds with SO_REUSEADDR, as servers do, so a closed connection's TIME_WAIT does not count."""
    import errno
    import socket

    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        return "host", f"{host!r} does not resolve ({e.strerror or e})"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            why = e.strerror or str(e)
            if e.errno == errno.EADDRINUSE:
                return (
                    "port",
                    f"{host}:{port} is already in use ({why}); stop that server or pick another port",
                )
            field = "port" if e.errno == errno.EACCES else "host"
            return field, f"cannot listen on {host}:{port} ({why})"
    return None


# ``flexspec generate``'s options by the EngineConfig / SamplingParams field each sets (errors name the option)
GENERATE_OPTIONS = {
    field: "--" + field.replace("_", "-")
    for field in ("model", "max_model_len", "device", "dtype", "speculative_config")
    + ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
}


@app.command()
def generate(
    prompt: str = typer.Argument(..., metavar="PROMPT", help="Prompt text (a user message when --chat)."),
    model: str = typer.Option("smollm2-135m-instruct", help="Model id, HF folder or .gguf file."),
    max_tokens: int = typer.Option(128, help="Maximum output tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(-1, help="Top-k; -1 or 0 = off."),
    seed: int | None = typer.Option(None, help="Sampling seed."),
    stop: list[str] | None = typer.Option(None, help="Stop string (repeatable)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Apply the model's chat template."),
    max_model_len: int = typer.Option(2048, help="Max prompt + output tokens."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16"),
    speculative_config: str | None = typer.Option(
        None, "--speculative-config", help='JSON, vLLM field names, e.g. \'{"method": "ngram", ...}\'.'
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Generate a completion for PROMPT with the engine (no server)."""
    from configs import EngineConfig, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop or [],
        )
        engine_args: dict = {"model": model, "max_model_len": max_model_len, "device": device, "dtype": dtype}
        if speculative_config:
            try:
                engine_args["speculative_config"] = json.loads(speculative_config)
            except json.JSONDecodeError as e:
                _fail(f"--speculative-config is not valid JSON: {e}")
        config = EngineConfig(**engine_args)
    except ValidationError as e:
        _fail(validation_message(e, options=GENERATE_OPTIONS))
    from flexspec.models.registry import unknown_model_problem

    spec_model = getattr(config.speculative_config, "model", None)
    for option, name, drafter in (
        ("--model", model, False),
        ("--speculative-config.model", spec_model, True),
    ):
        why = unknown_model_problem(name, drafter) if name else None
        if why:  # named after the option, before anything loads (as flexspec serve does)
            _fail(f"{option}: {why}")
    if not prompt:
        _fail("prompt must not be empty")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
        _fail(f"prompt is not valid UTF-8 text (position {e.start})")

    # importing the kernels reads no FLEXSPEC_* variable (the engine's modules below do)
    from flexspec_kernels._dispatch import EnvSettingError

    try:
        # FLEXSPEC_* environment variables are read as the engine's modules are imported and when it starts
        from flexspec.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        ids = (
            engine.apply_chat_template([{"role": "user", "content": prompt}])
            if chat
            else engine.encode(prompt)
        )
        check_context_length(len(ids), params.max_tokens, config.max_model_len)  # the server's 400
        t0 = time.perf_counter()
        out = engine.generate([ids], params)[0]
        elapsed = time.perf_counter() - t0
    except FlexspecError as e:
        _fail(e.message)
    except EnvSettingError as e:
        _fail(str(e))
    result = {
        "text": out.text,
        "token_ids": out.token_ids,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": out.num_output_tokens,
        "finish_reason": out.finish_reason,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(out.num_output_tokens / elapsed, 2) if elapsed > 0 else None,
    }
    if config.speculative_config is not None:
        result["spec_decode"] = engine.spec_metrics.as_dict()
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        typer.echo(out.text)


@app.command("prepare-model")
def prepare_model(
    model: str = typer.Argument("smollm2-135m-instruct", metavar="MODEL", help="Model id, folder or .gguf."),
) -> None:
    """Resolve MODEL and cache GGUF weights as safetensors, so later loads take seconds."""
    from flexspec.models.loader import resolve_model_dir

    try:
        path = resolve_model_dir(model)
    except FlexspecError as e:
        _fail(e.message)
    typer.echo(f"{model}: {path}")


@app.command()
def serve(
    config: str | None = typer.Option(
        None,
        "--config",
        "-c",
        help="Serve config file (default: configs/serve.yaml, else the installed copy).",
    ),
    address: str | None = typer.Option(
        None, help="Ray cluster to use ('auto' = the running one); default: start a new local cluster."
    ),
    num_cpus: int | None = typer.Option(None, min=1, help="CPUs of the local Ray cluster (default: all)."),
    host: str | None = typer.Option(None, help="Override http_options.host of the config."),
    port: int | None = typer.Option(None, min=1, max=65535, help="Override http_options.port of the config."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        help="Require 'Authorization: Bearer KEY' on /v1 (sets FLEXSPEC_API_KEY for the local cluster's "
        "processes; with --address, set it in the cluster's environment or ingress.api_key instead).",
    ),
    ready_timeout: float = typer.Option(
        1800.0, min=1, help="Seconds to wait for the apps to run before giving up (exit code 1)."
    ),
    speculative_config: str | None = typer.Option(
        None,
        "--speculative-config",
        help='JSON, vLLM field names, as for generate, e.g. \'{"method": "ngram", ...}\'; replaces the config '
        "file's speculative config; 'null' = plain decoding.",
    ),
) -> None:
    """Serve the OpenAI API on Ray Serve from a config file; blocks until SIGTERM / Ctrl-C (exit code 128 +
    signal: 143 / 130). Exit code 2: invalid config or --speculative-config, a model missing here, or a port this
    machine cannot listen on (all checked before Ray starts); 1: the deployment failed or cannot be placed."""
    import os
    from pathlib import Path

    try:
        from cluster.launcher import (
            ServeConfigError,
            default_config_path,
            load_serve_config,
            local_model_problems,
            parse_speculative_override,
            serve_forever,
        )
    except ImportError as e:
        _fail(f"serving needs the [serve] extra (pip install -e '.[serve]'): {e}")
    if speculative_config is not None:
        try:
            parse_speculative_override(speculative_config)
        except ServeConfigError as e:
            _fail(str(e))
    path = Path(config) if config else default_config_path()
    if not path.is_file():
        _fail(f"config file {path} not found")
    try:
        parsed = load_serve_config(path, host, port, speculative_config)
    except ServeConfigError as e:  # the file's fields are named after the file, the option's after itself
        _fail(str(e) if str(e).startswith("--") else f"{path}: {e}")
    if address is None:  # replicas run on this machine: their models must be here
        spec_field = "--speculative-config" if speculative_config is not None else None
        problems = local_model_problems(parsed, speculative_field=spec_field)
        if problems:  # the file's fields are named after the file, the option's after itself
            _fail("; ".join(p if p.startswith("--") else f"{path}: {p}" for p in problems))
        http = parsed.http_options  # the local cluster's proxy binds here: a taken port fails now, not in Ray
        problem = _listen_problem(http.host, http.port)
        if problem:
            field, why = problem
            given = host if field == "host" else port  # the option overrides the file's field
            _fail(f"{f'--{field}' if given is not None else f'{path}: http_options.{field}'}: {why}")
    if api_key:
        os.environ["FLEXSPEC_API_KEY"] = api_key  # inherited by the local Ray cluster's workers
    code = serve_forever(
        path,
        address=address,
        num_cpus=num_cpus,
        host=host,
        port=port,
        ready_timeout_s=ready_timeout,
        speculative_config=speculative_config,
    )
    raise typer.Exit(code)


# Operations (issue 8): the Grafana dashboard generated from the metric definitions in cluster/metrics.py.
dashboard_app = typer.Typer(no_args_is_help=True, help="Grafana dashboard of the serving metrics.")
app.add_typer(dashboard_app, name="dashboard")


@dashboard_app.command("export")
def dashboard_export(
    output: list[str] | None = typer.Option(
        None,
        "--output",
        "-o",
        help="File to write (repeatable; default: ops/grafana/ and the Helm chart's copy).",
    ),
) -> None:
    """Write the dashboard JSON (regenerated from the code's metric names)."""
    from pathlib import Path

    from cluster.dashboard import CHART_DASHBOARD_PATH, DASHBOARD_PATH, export

    paths = tuple(Path(p) for p in output) if output else (DASHBOARD_PATH, CHART_DASHBOARD_PATH)
    try:
        for path in export(paths):
            typer.echo(str(path))
    except OSError as e:
        _fail(str(e))


@dashboard_app.command("provision")
def dashboard_provision(
    grafana_url: str = typer.Option(..., help="Grafana base URL, e.g. http://grafana:3000."),
    prometheus_url: str = typer.Option(
        "http://prometheus:9090", help="URL Grafana reaches Prometheus at (the datasource it creates)."
    ),
    api_key: str | None = typer.Option(
        None, envvar="GRAFANA_API_KEY", help="API key / service-account token (env GRAFANA_API_KEY)."
    ),
    basic_auth: str | None = typer.Option(
        None, envvar="GRAFANA_BASIC_AUTH", help="USER:PASSWORD (env GRAFANA_BASIC_AUTH)."
    ),
    datasource_name: str = typer.Option("flexspec-prometheus", help="Name and uid of the datasource."),
    folder: str = typer.Option("flexspec", help="Folder (uid and title) of the dashboard; '' = General."),
) -> None:
    """Upload the dashboard and a Prometheus datasource to Grafana (created or updated in place)."""
    if api_key and basic_auth:
        _fail("give --api-key or --basic-auth, not both")
    credential: str | tuple[str, str] | None = api_key
    if basic_auth:
        user, sep, password = basic_auth.partition(":")
        if not sep or not user:
            _fail("--basic-auth must be USER:PASSWORD")
        credential = (user, password)
    try:
        from grafana_client.client import GrafanaException
        from requests import RequestException

        from cluster.dashboard_provision import provision
    except ImportError as e:
        _fail(f"provisioning needs the [ops] extra (pip install -e '.[ops]'): {e}")
    try:
        reply = provision(grafana_url, prometheus_url, credential, datasource_name, folder or None)
    except GrafanaException as e:
        _fail(f"Grafana refused the upload: {e}")
    except RequestException as e:
        _fail(f"cannot reach Grafana at {grafana_url}: {e}")
    typer.echo(
        f"dashboard {reply.get('uid')} version {reply.get('version')}: {grafana_url}{reply.get('url', '')}"
    )


# Drafter training (issue 5): the command lives in flexspec/train/cli.py.
from flexspec.train.cli import train_drafter

app.command("train-drafter")(train_drafter)


# Benchmarks (issues 2 and 7): argparse modules in bench/ (they also run without typer); this forwards to them.
@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)  # fmt: skip
def bench(ctx: typer.Context) -> None:
    """Benchmarks: `flexspec bench --dataset gsm8k --speculative-config JSON ...` (speculative decoding), or
    `flexspec bench engine|synthetic|plots ...`; `flexspec bench [engine|synthetic|plots] --help` for options."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # bench/ is a folder of the repository, next to flexspec/
        sys.path.append(root)
    from bench.cli import run, user_error

    try:
        run(list(ctx.args))
    except Exception as e:
        message = user_error(e)
        if message is None:
            raise
        _fail(message)


if __name__ == "__main__":
    app()
