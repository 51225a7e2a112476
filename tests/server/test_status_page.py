"""The status page in a real headless Chromium, against a real daemon with an API key.

The page loads with the key (HTTP Basic credentials, as a browser's prompt sends them) and
draws the running daemon's plan: its device and every layer of the model file. Its counters
move while a client streams; its chat box gets an answer, which then shows among the last
requests; a screenshot is kept. Without the key the page, its script, its data and the plan are
refused. The daemon logs in JSON here: each line is an object, the access lines carry the
request's fields.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading

import pytest

from hetero.gguf_loader import load_gguf
from tests.support.browser import artifacts_dir, chromium, keep
from tests.support.server_fixture import HOST, start_daemon

KEY = "office-key-123"
NAME = "office"
BEARER = {"Authorization": f"Bearer {KEY}"}
RAM_GB = 0.05  # a RAM tier below the CPU's pool: the page shows both
WAIT_MS = 60_000  # the model answers in seconds, on a busy machine in more


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(
        "--api-key", KEY, "--served-model-name", NAME, "--log-format", "json",
        "--num-kv-blocks", "256", "--max-num-seqs", "16", "--threads", "1",
        "--kv-ram-gb", str(RAM_GB),
    )  # fmt: skip
    yield d
    assert d.finish() == 0, d.log()


@pytest.fixture(scope="module")
def browser():
    path = chromium()  # skips, saying what is missing, where there is no browser or Playwright
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, daemon):
    ctx = browser.new_context(
        http_credentials={"username": "admin", "password": KEY},
        viewport={"width": 1200, "height": 1400},
    )
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    response = page.goto(daemon.url + "/")
    assert response.status == 200
    page.wait_for_selector("#plan svg g.stage", timeout=WAIT_MS)
    yield page
    assert not errors, errors  # no script error on the page all along
    ctx.close()


def number(page, selector: str) -> float:
    text = page.inner_text(selector)
    return float(text) if text not in ("-", "") else 0.0


def test_without_the_key_the_page_and_its_data_are_refused(daemon):
    for path in ("/", "/status", "/plan.svg", "/static/status.js", "/props", "/slots"):
        status, head, raw = daemon.request("GET", path)
        assert status == 401, path
        assert NAME not in raw.decode() and "<svg" not in raw.decode()
        want = "Basic" if path in ("/", "/status", "/plan.svg", "/static/status.js") else "Bearer"
        assert head["WWW-Authenticate"].startswith(want), path
    wrong = base64.b64encode(b"admin:not-the-key").decode()
    assert daemon.request("GET", "/status", headers={"Authorization": f"Basic {wrong}"})[0] == 401
    assert daemon.request("GET", "/health")[0] == 200  # probes stay open
    # a browser sends its Basic credentials with other sites' requests too: not taken there
    basic = {"Authorization": "Basic " + base64.b64encode(f"u:{KEY}".encode()).decode()}
    for site, status in (("cross-site", 401), ("same-site", 401), ("same-origin", 200)):
        headers = {**basic, "Sec-Fetch-Site": site}
        assert daemon.request("GET", "/status", headers=headers)[0] == status, site
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {**basic, "Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}
    assert daemon.request("POST", "/v1/chat/completions", chat, headers)[0] == 401
    for auth in (
        BEARER,
        {"Authorization": "Basic " + base64.b64encode(f"u:{KEY}".encode()).decode()},
    ):
        assert daemon.request("GET", "/status", headers=auth)[0] == 200


def test_a_browser_without_the_key_gets_no_page(browser, daemon):
    """Headless, the browser cannot show the prompt the 401 asks for: the navigation fails."""
    from playwright.sync_api import Error

    ctx = browser.new_context()
    page = ctx.new_page()
    with pytest.raises(Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
        page.goto(daemon.url + "/?no-key")
    ctx.close()
    refused = [x for x in access_lines(daemon) if x["path"] == "/" and x["status"] == 401]
    assert refused  # the daemon answered it with a 401 (the page's own successes log at debug)


def test_the_page_draws_the_running_plan(page, daemon, smollm2_path):
    n_layers = load_gguf(smollm2_path).config.n_layers
    status = json.loads(daemon.request("GET", "/status", headers=BEARER)[2])
    (stage,) = status["plan"]["stages"]
    (g,) = page.query_selector_all("#plan svg g.stage")
    assert g.get_attribute("data-device") == stage["device"] == "cpu"
    assert g.get_attribute("data-layers") == f"0-{n_layers - 1}"
    assert g.get_attribute("data-weights") == stage["weights"]
    bar = g.query_selector("rect.layers")
    track = g.query_selector("rect.track")
    assert float(bar.get_attribute("width")) == pytest.approx(float(track.get_attribute("width")))
    assert page.inner_text("#model-name") == NAME
    assert page.inner_text("#server-status") == "ready"
    assert f"{n_layers} layers" in page.inner_text("#model-detail")


def test_the_data_lists_kv_use_per_tier(daemon):
    status = json.loads(daemon.request("GET", "/status", headers=BEARER)[2])
    (stage,) = status["plan"]["stages"]
    pool, ram = status["live"]["kv"]
    assert pool["tier"] == "cpu" and pool["total"] == stage["num_kv_blocks"] == 256
    block = stage["kv_bytes"] / stage["num_kv_blocks"]
    assert ram["tier"] == "ram" and ram["total"] == int(RAM_GB * 2**30 // block)
    assert 0 <= ram["used"] <= ram["total"] and 0 <= pool["used"] <= pool["total"]


def stream(daemon, max_tokens: int, done: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about rivers."}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
    conn = http.client.HTTPConnection(HOST, daemon.port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), BEARER)
        resp = conn.getresponse()
        assert resp.status == 200
        while resp.read1(65536):
            pass
    finally:
        conn.close()
        done.set()


def test_counters_move_while_a_client_streams(page, daemon):
    before = number(page, "#tokens")
    done = threading.Event()
    client = threading.Thread(target=stream, args=(daemon, 96, done))
    client.start()
    try:
        # while the stream runs: one sequence running, tokens counted, a rate above zero
        page.wait_for_function(
            f"""() => document.getElementById('running').textContent === '1'
                && Number(document.getElementById('tokens').textContent) > {before}
                && Number(document.getElementById('tok-s').textContent) > 0""",
            timeout=WAIT_MS,
        )
        assert not done.is_set()  # seen during the stream, not after it
        busy = page.inner_text("#stages")
        assert "stage 0: cpu" in busy and "not measured" not in busy
        kv = page.inner_text("#kv")
        assert "/ 256 blocks" in kv and "ram" in kv
    finally:
        client.join(300)
    page.wait_for_function("document.getElementById('running').textContent === '0'")
    assert number(page, "#tokens") >= before + 96


def first_row_id(page) -> str | None:
    cell = page.query_selector("#requests tbody tr td:nth-child(2)")
    return cell.get_attribute("title") if cell else None  # the whole id (shown shortened)


def test_the_chat_box_gets_an_answer(page, daemon, tmp_path_factory):
    before = first_row_id(page)
    page.fill("#chat-input", "Name three colors.")
    page.click("#chat-send")
    page.wait_for_function(
        """() => { const m = document.querySelector('.msg.assistant');
                   return m && m.textContent.trim().length > 0
                       && !document.getElementById('chat-send').disabled; }""",
        timeout=WAIT_MS,
    )
    assert page.query_selector(".msg.assistant.failed") is None  # no error shown
    # the answer's request shows among the last requests, and in the daemon's JSON log
    page.wait_for_function(  # the table is redrawn from the next poll of /status
        f"""() => {{ const c = document.querySelector('#requests tbody tr td:nth-child(2)');
                    return c && c.title !== {json.dumps(before)}; }}""",
        timeout=WAIT_MS,
    )
    cells = [
        c.inner_text()
        for c in page.query_selector_all("#requests tbody tr")[0].query_selector_all("td")
    ]
    rid, request, status, model = first_row_id(page), cells[2], cells[3], cells[4]
    assert (request, status, model) == ("POST /v1/chat/completions", "200", NAME)
    (line,) = [x for x in access_lines(daemon) if x["request_id"] == rid]
    assert line["output_tokens"] > 0 and line["model"] == NAME and line["status"] == 200
    assert (
        cells[5] == f"{line['prompt_tokens']} / {line['cached_tokens']} / {line['output_tokens']}"
    )
    shot = artifacts_dir(tmp_path_factory) / "status_page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    keep(shot)


def access_lines(daemon) -> list[dict]:
    return [x for x in json_lines(daemon) if x["logger"] == "hetero.access"]


def json_lines(daemon) -> list[dict]:
    """The daemon's log lines, each a JSON object; the only other lines are the loading
    progress bars (tqdm's, drawn on the terminal, not log records)."""
    out = []
    for raw in daemon.log().splitlines():
        text = raw.split("\r")[-1].strip()
        if text.startswith("{"):
            out.append(json.loads(text))
        else:
            assert not text or "%|" in text, raw
    return out


def test_the_log_is_json_lines(daemon):
    status, head, raw = daemon.request("GET", "/v1/models", headers={"X-Request-Id": "no-key"})
    assert status == 401
    lines = json_lines(daemon)
    assert any(x["logger"] == "hetero.server" and x["message"].startswith("ready") for x in lines)
    (refused,) = [x for x in lines if x.get("request_id") == "no-key"]
    assert refused["level"] == "INFO" and refused["status"] == 401
    assert refused["error"] == json.loads(raw)["error"]["message"]
    assert (refused["method"], refused["path"]) == ("GET", "/v1/models")
