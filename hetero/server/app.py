"""`hetero-serve`: the command line of the OpenAI-compatible daemon.

Options come from flags, a TOML file (`--config`) and defaults, in that order of precedence. The
options are checked before anything heavy is imported, so `--help` and a bad config answer at
once; the application itself is in `hetero.server.daemon`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import click

from hetero.cli_options import FloatRange, engine_options
from hetero.log_format import configure as configure_logging
from hetero.server.config_file import apply_config
from hetero.server.safety_options import KEYS as SAFETY_KEYS
from hetero.server.safety_options import safety_options

SERVER_KEYS = (
    "model",
    "host",
    "port",
    "api_key",
    "served_model_name",
    "aliases",
    "strict_model_name",
    "max_request_bytes",
    "shutdown_grace",
    "log_level",
    "log_format",
    "log_requests",
    "log_requests_max_mb",
    "engine_process",
    "stream_interval_ms",
    "embedding_model",
    *SAFETY_KEYS,
)


class AutoOrMs(click.ParamType):
    """'auto' (None) or milliseconds >= 0; in a TOML file a number or "auto"."""

    name = "auto|ms"
    toml_kinds = (str, int, float)

    def convert(self, value, param, ctx) -> float | None:
        if value is None or str(value).strip().lower() == "auto":
            return None
        try:
            ms = float(value)
        except ValueError:
            self.fail(f"expected 'auto' or milliseconds, got {value!r}", param, ctx)
        if not ms >= 0:
            self.fail(f"must be >= 0 milliseconds, got {value!r}", param, ctx)
        return ms


@click.command(name="hetero-serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
@click.option("--served-model-name", default=None, help="model name for clients (default: file)")
@click.option(
    "--alias",
    "aliases",
    multiple=True,
    help="another name the model answers to, listed in /v1/models (repeatable)",
)
@click.option(
    "--strict-model-name/--no-strict-model-name",
    default=False,
    show_default=True,
    help="refuse (404) requests naming another model; by default any name is served by the one "
    "model loaded",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="TOML file of these options (flags given on the command line win)",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**64 - 1),
    default=None,
    help="seed of the engine's random stream, for requests that give none (a run then repeats)",
)
@click.option(
    "--max-request-bytes", type=click.IntRange(1024), default=8 * 2**20, show_default=True
)
@click.option(
    "--shutdown-grace",
    type=FloatRange(0),
    default=30.0,
    show_default=True,
    help="seconds in-flight requests get to finish on SIGINT/SIGTERM",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="log lines as text, or one JSON object per line (with the request log's fields)",
)
@click.option(
    "--log-requests",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write a JSON line per generation request here: the rendered prompt, token ids in and "
    "out with logprobs, sampling parameters, the engine's timing of each phase and step",
)
@click.option(
    "--log-requests-max-mb",
    type=FloatRange(0.001),
    default=64.0,
    show_default=True,
    help="rotate the --log-requests file at this size (3 older files are kept)",
)
@click.option(
    "--engine-process/--no-engine-process",
    default=True,
    show_default=True,
    help="run the engine in its own process (its loop and the HTTP work then have an "
    "interpreter each) or on a thread of the server's process",
)
@click.option(
    "--stream-interval-ms",
    type=AutoOrMs(),
    default="auto",
    show_default=True,
    help="least time between two streamed events of one request; its tokens of that time go "
    "in one event (0: each engine step's tokens at once; auto: 0 while at most 8 requests run, "
    "20 ms beyond, so that HTTP keeps up with a fast engine at many streams)",
)
@click.option(
    "--embedding-model",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="GGUF that answers /v1/embeddings (default: the served model), loaded in the server "
    "process on the same device",
)
@safety_options
@engine_options
@click.pass_context
def serve_cli(ctx: click.Context, config_path: str | None, **values) -> None:
    """Serve MODEL (default: SmolLM2-135M-Instruct) over the OpenAI API and llama.cpp's /infill."""
    from hetero.models import resolve_model

    if config_path:
        values = apply_config(ctx, values, config_path)
    server = {k: values.pop(k) for k in SERVER_KEYS}
    configure_logging(server.pop("log_level"), server.pop("log_format"))
    try:
        if not server["host"].strip():
            raise ValueError("--host is empty: give an address (0.0.0.0: every interface)")
        model_path = resolve_model(server.pop("model"))
        if model_path.is_dir():
            raise FileNotFoundError(f"{model_path} is a directory, not a GGUF model file")
        if not model_path.is_file():
            raise FileNotFoundError(f"no such model file: {model_path}")
        code = _serve(model_path, server, values)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise click.ClickException(str(e)) from e
    ctx.exit(code)


def _serve(model_path, server: dict, engine_options: dict) -> int:
    # torch and the engine load here, once the command line is known to be good.
    from hetero.factory import LaunchConfig
    from hetero.server.daemon import serve
    from hetero.server.request_trace import STEP_RECORDS
    from hetero.server.state import ServerSettings

    launch = LaunchConfig.from_options(**engine_options)
    if server["log_requests"] is not None:  # traces list the engine's steps of each request
        launch = replace(launch, engine=replace(launch.engine, trace_steps=STEP_RECORDS))
    settings = ServerSettings(model_path, **server, launch=launch)
    return asyncio.run(serve(settings))
