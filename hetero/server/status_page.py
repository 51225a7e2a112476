"""The status page at `/`, its data at `/status`, and the plan's drawing at `/plan.svg`.

The page is three static files in hetero/server/static/ (HTML, one script, one style sheet),
shipped in the wheel as package data: no build step, and nothing fetched from elsewhere when it
runs. Its script asks /status every second and draws the numbers; the chat box posts to
/v1/chat/completions and reads the stream.

With `--api-key`, the page and its data need the key like the API does. A browser cannot send a
Bearer header when it opens a page, so these paths also take HTTP Basic credentials (any user
name, the key as password) and their 401 asks for them (`WWW-Authenticate: Basic`): the browser
prompts once, then sends them with the page's own requests, the chat box's included. Scripts
keep using `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import base64
import binascii
from importlib import resources

from aiohttp import web

from hetero.server.access_log import ACCESS
from hetero.server.status_data import StatusData

PAGE_PATHS = ("/", "/status", "/plan.svg")  # and /static/*
STATIC = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
DATA: web.AppKey[StatusData] = web.AppKey("status_data", StatusData)
NO_STORE = {"Cache-Control": "no-store"}


def is_page(path: str) -> bool:
    return path in PAGE_PATHS or path.startswith("/static/")


def basic_key(request: web.Request) -> str | None:
    """The key in `Authorization: Basic base64(user:key)` (the password; the user name when
    the password is empty, as `curl -u KEY:` sends it), or None. A browser sends the Basic
    credentials it holds with requests other sites' pages make too, so a request it marks as
    coming from another site (Sec-Fetch-Site) gets no credit for them."""
    header = request.headers.get("Authorization", "")
    if header[:6].lower() != "basic ":
        return None
    if request.headers.get("Sec-Fetch-Site", "none") not in ("same-origin", "none"):
        return None
    try:
        user, _, password = base64.b64decode(header[6:].strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return password or user or None


def challenge(path: str) -> str:
    """The 401's WWW-Authenticate: Basic where a browser opens the page, else Bearer."""
    return 'Basic realm="hetero", charset="UTF-8"' if is_page(path) else "Bearer"


def _static_files() -> dict[str, bytes]:
    folder = resources.files("hetero.server").joinpath("static")
    return {
        f.name: f.read_bytes()
        for f in folder.iterdir()
        if f.is_file() and any(f.name.endswith(s) for s in STATIC)
    }


def add_routes(app: web.Application, state) -> None:
    app[DATA] = StatusData(state, app[ACCESS])
    files = _static_files()

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=files["index.html"], content_type="text/html", headers=NO_STORE)

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = STATIC.get(name[name.rfind(".") :]) if "." in name else None
        if name not in files or kind is None:
            raise web.HTTPNotFound()
        return web.Response(body=files[name], content_type=kind, headers=NO_STORE)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(await request.app[DATA].snapshot(), headers=NO_STORE)

    async def plan(request: web.Request) -> web.Response:
        svg = request.app[DATA].plan_svg()
        return web.Response(text=svg, content_type="image/svg+xml", headers=NO_STORE)

    app.router.add_get("/", page)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/status", status)
    app.router.add_get("/plan.svg", plan)
