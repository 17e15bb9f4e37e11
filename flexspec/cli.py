"""``flexspec`` command line (typer)."""

from __future__ import annotations

import json
import sys
import time

import typer
from pydantic import ValidationError

from flexspec.errors import FlexspecError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="flexspec: LLM serving with speculative decoding")


@app.callback()
def main() -> None:
    """flexspec: LLM serving on Ray with lossless speculative decoding."""


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text (a user message when --chat)."),
    model: str = typer.Option("smollm2-135m-instruct", help="Model id, HF folder or .gguf file."),
    max_tokens: int = typer.Option(128, help="Maximum output tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(-1, help="Top-k; -1 = off."),
    seed: int | None = typer.Option(None, help="Sampling seed."),
    stop: list[str] | None = typer.Option(None, help="Stop string (repeatable)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Apply the model's chat template."),
    max_model_len: int = typer.Option(2048, help="Max prompt + output tokens."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16"),
    speculative_config: str | None = typer.Option(
        None, "--speculative-config", help="JSON, vLLM field names, e.g. '{\"method\": \"ngram\", ...}'."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Generate a completion for PROMPT with the engine (no server)."""
    from configs import EngineConfig, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop or []
        )
        engine_args: dict = dict(model=model, max_model_len=max_model_len, device=device, dtype=dtype)
        if speculative_config:
            try:
                engine_args["speculative_config"] = json.loads(speculative_config)
            except json.JSONDecodeError as e:
                _fail(f"--speculative-config is not valid JSON: {e}")
        config = EngineConfig(**engine_args)
    except ValidationError as e:
        _fail(_validation_message(e))
    if not prompt:
        _fail("prompt must not be empty")

    from flexspec.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
        ids = engine.apply_chat_template([{"role": "user", "content": prompt}]) if chat else engine.encode(prompt)
        t0 = time.perf_counter()
        out = engine.generate([ids], params)[0]
        elapsed = time.perf_counter() - t0
    except FlexspecError as e:
        _fail(e.message)
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
def prepare_model(model: str = typer.Argument("smollm2-135m-instruct", help="Model id, folder or .gguf.")) -> None:
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
        None, "--config", "-c", help="Serve config file (default: configs/serve.yaml, else the installed copy)."
    ),
    address: str | None = typer.Option(
        None, help="Ray cluster to use ('auto' = the running one); default: start a new local cluster."
    ),
    num_cpus: int | None = typer.Option(None, help="CPUs of the local Ray cluster (default: all)."),
    host: str | None = typer.Option(None, help="Override http_options.host of the config."),
    port: int | None = typer.Option(None, help="Override http_options.port of the config."),
) -> None:
    """Serve the OpenAI API on Ray Serve from a config file; blocks until SIGTERM / Ctrl-C."""
    from pathlib import Path

    try:
        from cluster.launcher import default_config_path, load_serve_config, serve_forever
    except ImportError as e:
        _fail(f"serving needs the [serve] extra (pip install -e '.[serve]'): {e}")
    path = Path(config) if config else default_config_path()
    if not path.is_file():
        _fail(f"config file {path} not found")
    try:
        load_serve_config(path, host, port)
    except ValidationError as e:
        _fail(f"{path}: {_validation_message(e)}")
    except (ValueError, OSError) as e:
        _fail(f"{path}: {e}")
    raise typer.Exit(serve_forever(path, address=address, num_cpus=num_cpus, host=host, port=port))


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
    from bench.cli import run

    run(list(ctx.args))


if __name__ == "__main__":
    app()
