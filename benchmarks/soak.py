"""A long day of traffic: the daemon under C clients for 20 minutes or more, then the checks.

    python benchmarks/soak.py [--minutes 20] [--clients 64] [--out soak.json] [-- SERVE ARGS]

Starts `hetero-serve` (the default model unless SERVE ARGS name one) on 127.0.0.1, runs the
mixed load of hetero/server/soak_requests.py from C clients on loopback, and at the end checks:

* every answer that finished is complete, every 4xx names its cause (listed if not);
* KV blocks in use are back to zero, nothing runs or waits;
* the engine process's resident memory after the warm-up (the first --warmup-minutes): its
  first and last sample, range and least-squares slope, so "flat" has a number; the server
  process's too.

Prints the tally and the memory figures; --out writes them as JSON. Exit status 1 when a check
fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click

from hetero.models import resolve_model
from hetero.server.soak import MemoryTrace, blocks_in_use, run_soak, settle
from hetero.server.soak_requests import Planner
from hetero.tokenizer import Tokenizer

MAX_BYTES = 256 * 1024  # --max-request-bytes of the daemon: the over-limit body passes it


def start(serve_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hetero.server", *serve_args, "--host", "127.0.0.1",
           "--port", str(port), "--max-request-bytes", str(MAX_BYTES)]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the daemon did not come up")


async def soak(url: str, pids: dict[str, int], opts: dict) -> dict:
    planner = Planner(random.Random(opts["seed"]), MAX_BYTES, opts["context"], opts["fim"])
    trace = MemoryTrace(pids, every_s=opts["sample_s"])
    stop = asyncio.Event()
    sampler = asyncio.create_task(trace.run(stop))
    tally = await run_soak(url, opts["clients"], opts["minutes"] * 60, planner)
    gauges = await settle(url)
    stop.set()
    await sampler
    warmup = opts["warmup_minutes"] * 60
    return {
        "tally": tally.summary(),
        "kv_blocks_in_use_after": blocks_in_use(gauges),
        "running_after": gauges.get("hetero_num_requests_running"),
        "waiting_after": gauges.get("hetero_num_requests_waiting"),
        "memory_after_warmup": {name: trace.flatness(name, warmup) for name in pids},
        "memory_samples": [(round(t, 1), r) for t, r in trace.samples],
        "throughput_tokens_per_s": round(tally.tokens / max(tally.seconds, 1e-9), 1),
    }


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--minutes", type=float, default=20.0, show_default=True)
@click.option("--clients", type=int, default=64, show_default=True)
@click.option("--warmup-minutes", type=float, default=5.0, show_default=True)
@click.option("--sample-s", type=float, default=5.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def main(serve_args: tuple[str, ...], out: Path | None, **opts) -> None:
    args = list(serve_args)
    model = resolve_model(args[0] if args and not args[0].startswith("-") else None)
    tok = Tokenizer.from_gguf(model)
    opts["fim"] = tok.fim.prefix is not None and tok.fim.middle is not None
    log = Path(tempfile.mkstemp(prefix="hetero-soak-", suffix=".log")[1])
    proc, url = start(args, log)
    try:
        engine = re.findall(r"engine process started \(pid (\d+)\)", log.read_text())
        pids = {"server": proc.pid, **({"engine": int(engine[-1])} if engine else {})}
        with urllib.request.urlopen(url + "/v1/models") as r:
            opts["context"] = json.loads(r.read())["data"][0].get("max_model_len") or 8192
        result = asyncio.run(soak(url, pids, opts))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    result.update(model=str(model), serve_args=args, clients=opts["clients"], fim=opts["fim"],
                  minutes=opts["minutes"], daemon_exit=code, log=str(log))  # fmt: skip
    report(result)
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
    failed = result["tally"]["problems"] or result["kv_blocks_in_use_after"] or code
    sys.exit(1 if failed else 0)


def report(r: dict) -> None:
    t = r["tally"]
    print(f"soak: {r['minutes']} min, {r['clients']} clients, {r['model']} {r['serve_args']}")
    print(f"  sent        {sum(t['sent'].values())}  {t['sent']}")
    print(f"  complete    {sum(t['complete'].values())}  {t['complete']}")
    print(f"  refused     {sum(t['refused_with_cause'].values())}  {t['refused_with_cause']}")
    print(f"  cut streams {t['cut_streams']}, abandoned {t['abandoned']}")
    print(f"  statuses    {t['statuses']}")
    print(f"  tokens      {t['completion_tokens']} ({r['throughput_tokens_per_s']} tok/s)")
    print(f"  problems    {len(t['problems'])}")
    for p in t["problems"][:20]:
        print(f"    {p}")
    print(f"  KV blocks in use after: {r['kv_blocks_in_use_after']:.0f}; running "
          f"{r['running_after']}, waiting {r['waiting_after']}")  # fmt: skip
    for name, m in r["memory_after_warmup"].items():
        print(f"  {name} RSS after warm-up: {m}")
    print(f"  daemon exit status {r['daemon_exit']}; log {r['log']}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
