"""The engine core in its own process: the daemon's scheduler, runner, KV cache and sampler.

The server process keeps everything per token that is not the model (HTTP, SSE, JSON,
detokenization); this process keeps the engine loop. Each runs on its own interpreter, so the
engine's Python step and the event loop's work per token no longer take turns on one GIL
(vLLM V1's engine-core process). wire.py lists the messages; client.py is the other end.

A reader thread moves commands from the pipe into a queue, so the pipe is always drained and a
server writing a long prompt never waits for a step to end (nor can the two processes block on
each other's full pipes). The main thread steps the engine and sends one message per step.

SIGINT and SIGTERM are ignored here: a terminal's Ctrl-C and a service manager's SIGTERM reach
every process of the group, and the server process decides how the engine stops (the grace
period, then a "shutdown" command). When the server process goes away without one, the command
pipe ends and this process stops by itself.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from multiprocessing.connection import Connection

from hetero.frontdoor.wire import (
    Abort,
    Add,
    Died,
    Embed,
    Embedded,
    EngineInfo,
    GaugesQuery,
    GaugesReply,
    LoadFailed,
    Ready,
    StepDone,
    dumps,
    pack_outputs,
)
from hetero.log_format import configure as configure_logging

log = logging.getLogger("hetero.engine")
IDLE_WAIT_S = 0.5  # how long an idle loop waits for a command before looking again


def engine_main(cmd: Connection, out: Connection, model_path, launch, level: int) -> None:
    """Process entry point: load the engine, say ready (or why not), then serve commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(level)  # in the server's --log-format (inherited through the environment)
    from hetero.launch import build_engine  # torch loads here, after the signals are set

    try:
        engine = build_engine(model_path, launch, progress=True)
        engine.constraints.warm()  # the grammars' vocabulary, before the first request
    except BaseException as e:
        out.send_bytes(dumps(LoadFailed(f"{type(e).__name__}: {e}")))
        return
    out.send_bytes(dumps(Ready(EngineInfo.of(engine))))
    try:
        CoreLoop(engine, cmd, out).run()
    finally:
        engine.close()


class CoreLoop:
    def __init__(self, engine, cmd: Connection, out: Connection) -> None:
        self.engine = engine
        self.out = out
        self.commands: queue.Queue = queue.Queue()
        self.refused: list[tuple[str, str]] = []
        self.stopping = False
        threading.Thread(
            target=self._read, args=(cmd,), name="hetero-commands", daemon=True
        ).start()

    def _read(self, cmd: Connection) -> None:
        while True:
            try:
                self.commands.put(cmd.recv())
            except (EOFError, OSError):  # the server process is gone
                self.commands.put(None)
                return

    def run(self) -> None:
        engine = self.engine
        try:
            while not self.stopping:
                self._drain(block=not engine.has_unfinished())
                outs = engine.step() if engine.has_unfinished() and not self.stopping else []
                if outs or self.refused:
                    self.stopping = not self._send(StepDone(pack_outputs(outs), self.refused))
                    self.refused = []
        except BaseException as e:  # the server fails its requests with this reason and exits
            log.exception("the engine loop died")
            self._send(Died(f"engine error: {type(e).__name__}: {e}"))
            raise
        self._stop()

    def _drain(self, block: bool) -> None:
        try:
            msg = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(msg)
            if self.stopping:
                return
            try:
                msg = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, msg) -> None:
        if isinstance(msg, Add):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_ids, msg.params)
            except ValueError as e:  # refused: the server raises it to the request's handler
                self.refused.append((msg.request_id, str(e)))
        elif isinstance(msg, Abort):
            self.engine.abort(msg.request_id)
        elif isinstance(msg, Embed):
            self._send(self._embedded(msg))
        elif isinstance(msg, GaugesQuery):
            self._send(GaugesReply(msg.token, self.engine.gauges()))
        else:  # Shutdown, or None: the server process is gone
            self.stopping = True

    def _embedded(self, msg: Embed) -> Embedded:
        try:
            return Embedded(msg.token, self.engine.embed(msg.prompts))
        except Exception as e:  # a refusal, or a failed forward: the request's, not the loop's
            refused = isinstance(e, ValueError)
            if not refused:
                log.exception("embeddings failed")
            return Embedded(msg.token, None, (refused, str(e)))

    def _stop(self) -> None:
        """Free what is left (the server tells its clients why) and keep the prefixes."""
        for rid in list(self.engine.params):
            self.engine.abort(rid)
        saved = self.engine.save_kv_cache()
        if saved:
            log.info("saved %d KV blocks to the disk tier", saved)

    def _send(self, msg) -> bool:
        """False when the server process is gone (nobody to tell: this process stops)."""
        try:
            self.out.send_bytes(dumps(msg))
        except OSError:
            return False
        return True
