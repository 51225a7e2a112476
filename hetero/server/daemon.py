"""The aiohttp application of `hetero-serve` and its life cycle.

Start: the listener opens first (so /health can answer 503 while loading), then the model loads
on a thread with a progress bar, then one line says the server is ready. SIGINT/SIGTERM: stop
listening, refuse new requests (503), give in-flight requests `--shutdown-grace` seconds to end,
then stop the engine, which ends the rest with a message saying why (an error event for streams,
a 503 for the others). An engine that dies on its own fails its requests with the reason and is
started again (frontdoor/supervisor.py); past --engine-restarts deaths the server exits with
status 1 and the reason (a service manager restarts it), never serving nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys

from aiohttp import web

from hetero.server import anthropic_api, embeddings, infill, openai_api, status_page, tokenize
from hetero.server.access_log import ACCESS, AccessLog, access_middleware, echo_request_id
from hetero.server.anthropic_protocol import error_body as anthropic_error
from hetero.server.llama_props import props, slots
from hetero.server.protocol import ApiError, error_body
from hetero.server.request_trace import open_trace
from hetero.server.state import STATE, ServerSettings, ServerState, add_ignored_header

log = logging.getLogger("hetero.server")
# Everything but /health and /metrics needs the key; the API answers with and without /v1.
PUBLIC = ("/health", "/metrics")
DRAIN_TAIL_S = 10.0  # after the grace period: time for handlers to tell their clients why
# With the engine on a thread (--no-engine-process), it and the event loop share the GIL. With
# Python's default 5 ms switch interval a thread that wants it back (the loop with tokens to send,
# the engine after a device sync) can wait that long each time. Measured on an H200 with a 135M
# model, one stream: HTTP decode went from about 85% of the offline engine's speed to 100-105%
# with 0.5 ms.
GIL_SWITCH_INTERVAL_S = 0.0005


def _error_response(
    request: web.Request, status: int, message: str, code: str | int | None = None
) -> web.Response:
    if request.path.startswith(anthropic_api.PATHS):  # Anthropic's clients read its shape
        return web.json_response(anthropic_error(status, message), status=status)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response(error_body(message, kind, None, code), status=status)


def _endpoint(request: web.Request) -> str:
    route = request.match_info.route
    return route.resource.canonical if route.resource is not None else "unmatched"


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's JSON shape; every answer counted for /metrics."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except ApiError as e:
        status = e.status
        if request.path.startswith(anthropic_api.PATHS):
            response = _error_response(request, e.status, e.message)
        else:
            response = web.json_response(e.body(), status=e.status)
        if e.status == 401:
            response.headers["WWW-Authenticate"] = status_page.challenge(request.path)
        return response
    except web.HTTPRequestEntityTooLarge as e:
        status = e.status
        limit = request.app[STATE].settings.max_request_bytes
        return _error_response(request, 413, f"the request body is larger than {limit} bytes", 413)
    except web.HTTPException as e:  # routing: 404, 405
        status = e.status
        return _error_response(request, e.status, f"{e.reason}: {request.method} {request.path}")
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's code for it)
        raise
    except Exception:
        log.exception("error while serving %s %s", request.method, request.path)
        return _error_response(request, 500, "internal server error (see the server's log)")
    finally:
        request.app[STATE].metrics.http[(_endpoint(request), status)] += 1


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[STATE].settings.api_key
    if key and request.path not in PUBLIC:
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else None
        given = given or status_page.basic_key(request) or request.headers.get("X-Api-Key")
        if not given:
            raise ApiError(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_ready()
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = state.metrics.render(await state.engine_gauges(), state.status)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def create_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[access_middleware, errors_middleware, auth_middleware],
        client_max_size=state.settings.max_request_bytes,
    )
    app[STATE] = state
    app[ACCESS] = AccessLog(open_trace(state))  # the request log, and its traces
    app.on_response_prepare.extend([add_ignored_header, echo_request_id])
    app.on_cleanup.append(lambda app: app[ACCESS].close())
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/props", props)  # llama.cpp's tooling endpoints
    app.router.add_get("/slots", slots)
    status_page.add_routes(app, state)  # /, /status, /plan.svg, /static/*
    for prefix in ("/v1", ""):  # clients configured with a base URL without /v1 work too
        app.router.add_get(f"{prefix}/models", openai_api.models)
        app.router.add_get(f"{prefix}/models/{{model:.+}}", openai_api.model)  # names hold "/"
        app.router.add_post(f"{prefix}/chat/completions", openai_api.chat_completions)
        app.router.add_post(f"{prefix}/completions", openai_api.completions)
        app.router.add_post(f"{prefix}/embeddings", embeddings.embeddings)
        app.router.add_post(f"{prefix}/messages", anthropic_api.messages)
        app.router.add_post(f"{prefix}/messages/count_tokens", anthropic_api.count_tokens)
    app.router.add_post("/infill", infill.infill)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    return app


# -- life cycle ----------------------------------------------------------------------------------


async def serve(settings: ServerSettings) -> int:
    """Run until SIGINT/SIGTERM; 0 on a clean stop, 1 when the model failed to load."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    state = ServerState(settings)
    runner = web.AppRunner(
        create_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=2.0
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {settings.host!r} port {settings.port}: {e}") from e
    host, port = runner.addresses[0][:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # IPv6: [::1]
    log.info("listening on %s; loading %s", url, settings.model_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = await _load_then_wait(state, stop, url)
    await _drain(state, runner, settings.shutdown_grace)
    log.info("stopped")
    return code


async def _load_then_wait(state: ServerState, stop: asyncio.Event, url: str) -> int:
    loader = asyncio.create_task(state.load())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not loader.done():  # a signal while loading: the loading thread dies with the process
        loader.cancel()
        return 0
    if loader.exception() is not None:
        log.error("the model failed to load: %s", state.error)
        stopper.cancel()
        return 1
    engine = state.engine
    log.info(
        "ready: %s/v1 serves %s as %r (context %d tokens); %s",
        url,
        state.settings.model_path,
        state.served_name,
        engine.max_model_len,
        engine.kv_description,
    )
    died = asyncio.create_task(state.engine_died.wait())
    await asyncio.wait({stopper, died}, return_when=asyncio.FIRST_COMPLETED)
    if not stopper.done():
        stopper.cancel()
        log.error("the server stops: %s", state.error)
        return 1
    died.cancel()
    return 0


async def _drain(state: ServerState, runner: web.AppRunner, grace: float) -> None:
    if state.status in ("ready", "restarting"):
        state.status = "draining"
    for site in list(runner.sites):
        await site.stop()  # no new connections; requests on open ones get a 503
    pending = state.metrics.in_flight
    if pending:
        log.info("shutting down: %d requests in flight get up to %.0f s to finish", pending, grace)
    if not await state.wait_idle(grace):
        log.warning("grace period over: stopping %d requests", state.metrics.in_flight)
    await asyncio.get_running_loop().run_in_executor(None, state.close)
    await state.wait_idle(DRAIN_TAIL_S)
    await runner.cleanup()
