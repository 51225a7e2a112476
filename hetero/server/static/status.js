// hetero's status page: polls /status every second, draws /plan.svg, and runs a small chat.
// Plain browser JavaScript, no dependencies. Text from the server goes in through textContent
// only (request errors may echo what a client sent).
"use strict";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
let modelName = null;
let planStages = -1; // stages drawn so far (-1: none): redrawn when the engine's layout changes
const chat = []; // the conversation sent with each chat request

function fmt(x, digits = 1) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

function pct(x) {
  return x === null || x === undefined ? "-" : (100 * x).toFixed(0) + " %";
}

function showError(text) {
  const el = $("error");
  el.hidden = !text;
  el.textContent = text || "";
}

async function poll() {
  try {
    const r = await fetch("/status", { cache: "no-store" });
    if (!r.ok) {
      showError(`/status answered ${r.status}` + (r.status === 401 ? ": the API key is needed" : ""));
      return;
    }
    render(await r.json());
    showError(null);
  } catch (e) {
    showError(`the daemon does not answer (${e})`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function render(s) {
  modelName = s.model.name;
  $("model-name").textContent = s.model.name;
  const badge = $("server-status");
  badge.textContent = s.status;
  badge.className = "badge " + s.status;
  const ctx = s.model.context ? `context ${s.model.context} tokens, ${s.model.n_layers} layers` : "";
  $("model-detail").textContent = ctx;
  $("version").textContent = `hetero ${s.version}, up ${fmt(s.uptime_s / 60, 1)} min`;
  if (s.plan.stages.length !== planStages) drawPlan(s.plan.stages.length);
  renderLive(s.live);
  renderRequests(s.requests);
}

async function drawPlan(n) {
  planStages = n;
  if (!n) return;
  const r = await fetch("/plan.svg", { cache: "no-store" });
  if (r.ok) $("plan").innerHTML = await r.text(); // the daemon's own SVG (escaped there)
}

function renderLive(live) {
  $("tok-s").textContent = fmt(live.tok_s, 1);
  $("tokens").textContent = live.tokens_streamed;
  $("running").textContent = live.requests_running ?? "-";
  $("waiting").textContent = live.requests_waiting ?? "-";
  $("in-flight").textContent = live.requests_in_flight;
  $("prefix-hit").textContent = pct(live.prefix_hit_rate);
  const spec = live.spec_acceptance;
  $("spec").textContent = spec === null || spec === undefined
    ? "off" : `${pct(spec)} (${live.spec_accepted}/${live.spec_proposed})`;
  bars($("kv"), (live.kv || []).map((t) => [
    t.tier, t.total ? t.used / t.total : 0, `${t.used} / ${t.total} blocks`,
  ]), "");
  bars($("stages"), live.stages.map((s, i) => [
    `stage ${i}: ${s.device}`, s.busy || 0, s.busy === null ? "not measured" : pct(s.busy),
  ]), "busy");
}

function bars(el, rows, kind) {
  el.replaceChildren(...rows.map(([name, share, text]) => {
    const row = document.createElement("div");
    row.className = "bar-row";
    const label = document.createElement("span");
    label.textContent = name;
    const bar = document.createElement("div");
    bar.className = "bar " + kind;
    const fill = document.createElement("span");
    fill.style.width = `${Math.min(100, 100 * share).toFixed(1)}%`;
    bar.append(fill);
    const value = document.createElement("span");
    value.textContent = text;
    row.append(label, bar, value);
    return row;
  }));
}

function renderRequests(requests) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren(...requests.map((q) => {
    const tr = document.createElement("tr");
    if (q.status >= 400 || q.error) tr.className = "err";
    const tokens = q.prompt_tokens === undefined
      ? "" : `${q.prompt_tokens} / ${q.cached_tokens} / ${q.output_tokens}`;
    const spec = q.spec_proposed ? `${q.spec_accepted}/${q.spec_proposed}` : "";
    const cells = [
      new Date(q.time * 1000).toLocaleTimeString(), q.request_id, `${q.method} ${q.path}`,
      q.status, q.model || "", tokens, q.ttft_s == null ? "" : fmt(q.ttft_s, 3) + " s",
      fmt(q.total_s, 3) + " s", q.finish_reason || "", spec, q.error || "",
    ];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.append(td);
    }
    const id = tr.children[1]; // long ids shortened; the whole one on hover
    id.title = q.request_id;
    if (q.request_id.length > 16) id.textContent = q.request_id.slice(0, 12) + "...";
    return tr;
  }));
}

// -- the chat box ------------------------------------------------------------------------------

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.textContent = text;
  $("chat-log").append(el);
  el.scrollIntoView({ block: "nearest" });
  return el;
}

async function send(text) {
  chat.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  $("chat-send").disabled = true;
  let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: modelName, messages: chat, stream: true, max_tokens: 256 }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    answer = await readStream(r, (delta) => { out.textContent += delta; });
    chat.push({ role: "assistant", content: answer });
  } catch (e) {
    out.classList.add("failed");
    out.textContent = answer + ` [${e.message}]`;
    chat.pop(); // the question stays shown, not in the next request's history
  } finally {
    $("chat-send").disabled = false;
  }
}

async function readStream(response, onDelta) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return text;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
      const data = JSON.parse(event.slice(6));
      if (data.error) throw new Error(data.error.message);
      const delta = data.choices.length ? data.choices[0].delta.content || "" : "";
      text += delta;
      onDelta(delta);
    }
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || $("chat-send").disabled) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("chat-clear").addEventListener("click", () => {
  chat.length = 0;
  $("chat-log").replaceChildren();
});
poll();
