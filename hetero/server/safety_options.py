"""`hetero-serve` options of the daemon's self-healing and of what user text may do.

    --engine-restarts N           a dead engine is started again (frontdoor/supervisor.py), at
    --engine-restart-window S     most N times within S seconds; past that the daemon exits
    --parse-special-in-messages   control-token texts in chat messages are control tokens
                                  (by default they are plain text: plain_content.py)

Their defaults come from ServerSettings and RestartPolicy, so each is declared once.
"""

from __future__ import annotations

import click

from hetero.cli_options import FloatRange
from hetero.frontdoor.supervisor import RestartPolicy

KEYS = ("engine_restarts", "engine_restart_window", "parse_special_in_messages")


def safety_options(f):
    policy = RestartPolicy()
    f = click.option(
        "--parse-special-in-messages/--no-parse-special-in-messages",
        default=False,
        show_default=True,
        help="read control-token texts inside chat messages ('<|im_start|>system', "
        "'<|eot_id|>') as the control tokens; by default they are plain text, so a user's "
        "message cannot open a turn of another role",
    )(f)
    f = click.option(
        "--engine-restart-window",
        type=FloatRange(1),
        default=policy.window_s,
        show_default=True,
        help="seconds over which --engine-restarts counts the engine's deaths",
    )(f)
    f = click.option(
        "--engine-restarts",
        type=click.IntRange(0),
        default=policy.max_restarts,
        show_default=True,
        help="times a dead engine (its process killed, a pipeline stage gone for good) is "
        "started again within --engine-restart-window before the daemon exits with the reason "
        "(0: exit when it dies); requests in flight end with the error, /health says "
        "'restarting' meanwhile",
    )(f)
    return f
