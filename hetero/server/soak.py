"""A long day of traffic against a running daemon, and what must hold at its end.

    tally = await run_soak(url, clients=64, seconds=1200, planner=Planner(...))

C clients on one event loop, each sending the next request (soak_requests.py: chat, streams,
logprobs, JSON mode, n=2, long prompts, FIM, a few over the limits; some cut or abandoned by
their client) as soon as its last one ended, until the time is up. Every answer is checked as it
comes; the tally counts them by kind and lists the problems. `settle` then waits until the
daemon has nothing in flight and reads its gauges: KV blocks in use must be back to zero.
`MemoryTrace` samples processes' resident memory meanwhile, to tell whether it stays flat.

benchmarks/soak.py runs this for 20 minutes or more; tests/server/test_server_soak.py for
seconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil

from hetero.server.metrics import parse_metrics
from hetero.server.soak_requests import Planned, Planner, check_answer, check_error, check_stream

READ_TIMEOUT_S = 900.0  # one answer on a loaded CPU (a long prompt behind 63 others)


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)  # kind -> requests sent
    done: Counter = field(default_factory=Counter)  # kind -> complete answers
    refused: Counter = field(default_factory=Counter)  # kind -> 4xx that named their cause
    statuses: Counter = field(default_factory=Counter)
    cut: int = 0  # streams their client left after a few events
    abandoned: int = 0  # plain requests their client gave up on
    tokens: int = 0  # completion tokens of complete answers
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "sent": dict(self.sent),
            "complete": dict(self.done),
            "refused_with_cause": dict(self.refused),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "cut_streams": self.cut,
            "abandoned": self.abandoned,
            "completion_tokens": self.tokens,
            "problems": self.problems,
        }


async def run_soak(url: str, clients: int, seconds: float, planner: Planner) -> Tally:
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_S)
    conn = aiohttp.TCPConnector(limit=0)  # one connection per client at least
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        await asyncio.gather(*(_client(session, url, planner, tally, deadline) for _ in
                               range(clients)))  # fmt: skip
    tally.seconds = time.monotonic() - t0
    return tally


async def _client(session, url: str, planner: Planner, tally: Tally, deadline: float) -> None:
    while time.monotonic() < deadline:
        p = planner.draw()
        tally.sent[p.kind] += 1
        try:
            if p.abandon_s is None:
                await _one(session, url, p, tally)
                continue
            try:  # cancelled mid-request: the connection closes, as a client that gave up
                await asyncio.wait_for(_one(session, url, p, tally), p.abandon_s)
            except TimeoutError:
                tally.abandoned += 1
        except (aiohttp.ClientError, OSError) as e:
            tally.problems.append(f"{p.kind}: {type(e).__name__}: {e}")


async def _one(session, url: str, p: Planned, tally: Tally) -> None:
    data = p.body if isinstance(p.body, bytes) else json.dumps(p.body).encode()
    headers = {"Content-Type": "application/json"}
    async with session.post(url + p.path, data=data, headers=headers) as resp:
        tally.statuses[resp.status] += 1
        if resp.status != 200:
            body = await _json(resp)
            if 400 <= resp.status < 500:
                problem = check_error(p, resp.status, body)
            else:
                problem = f"{p.kind}: HTTP {resp.status}: {body!r:.300}"
            _count(tally, tally.refused, p, problem)
            return
        if p.expect is not None:
            tally.problems.append(f"{p.kind}: answered 200, expected a refusal naming {p.expect}")
            return
        if not p.stream:
            body = await _json(resp)
            _count(tally, tally.done, p, check_answer(p, body), body.get("usage"))
            return
        events = await _events(resp, p.cut_after)
        if events is None:
            tally.cut += 1
            return
        usage = events[-2].get("usage") if len(events) > 1 else None
        _count(tally, tally.done, p, check_stream(p, events), usage)


def _count(tally: Tally, counter: Counter, p: Planned, problem: str | None, usage=None) -> None:
    if problem is not None:
        tally.problems.append(problem)
        return
    counter[p.kind] += 1
    if usage:
        tally.tokens += usage.get("completion_tokens", 0)


async def _json(resp) -> Any:
    raw = await resp.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


async def _events(resp, cut_after: int | None) -> list[Any] | None:
    """The stream's data payloads; None when the client left after `cut_after` of them."""
    events: list[Any] = []
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        if cut_after is not None and len(events) >= cut_after and events[-1] != "[DONE]":
            resp.close()  # the client goes away mid-stream
            return None
    return events


# -- the end -----------------------------------------------------------------------------------


async def settle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """The daemon's gauges once nothing is in flight (aborts of the cut requests included)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "/metrics") as resp:
                m = parse_metrics(await resp.text())
            idle = m.get("hetero_requests_in_flight", 0) == 0
            idle = idle and m.get("hetero_num_requests_running", 0) == 0
            if idle and m.get("hetero_num_requests_waiting", 0) == 0:
                return m
            if time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.5)


def blocks_in_use(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("hetero_kv_blocks_used"))


class MemoryTrace:
    """Resident memory of named processes, every `every_s` seconds, while `run` is awaited."""

    def __init__(self, pids: dict[str, int], every_s: float = 5.0) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._t0 = time.monotonic()

    def sample(self) -> None:
        rss = {}
        for name, p in self.procs.items():
            try:
                rss[name] = p.memory_info().rss
            except psutil.Error:
                continue
        self.samples.append((time.monotonic() - self._t0, rss))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass
        self.sample()

    def flatness(self, name: str, warmup_s: float) -> dict[str, float]:
        """After warm-up: first, last, min and max in MiB, and the least-squares slope (MiB per
        hour) of the process's resident memory."""
        pts = [(t, r[name] / 2**20) for t, r in self.samples if name in r and t >= warmup_s]
        if len(pts) < 2:
            return {}
        n = len(pts)
        mt, mr = sum(t for t, _ in pts) / n, sum(r for _, r in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        slope = sum((t - mt) * (r - mr) for t, r in pts) / var if var else 0.0
        rs = [r for _, r in pts]
        return {
            "samples": n,
            "first_mib": round(rs[0], 1),
            "last_mib": round(rs[-1], 1),
            "min_mib": round(min(rs), 1),
            "max_mib": round(max(rs), 1),
            "slope_mib_per_hour": round(slope * 3600, 2),
        }
