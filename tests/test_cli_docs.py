"""docs/cli.md is click's own help of every command, so the page cannot drift from the code.

After changing an option: `python tests/test_cli_docs.py` writes the page again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
WIDTH = 100

INTRO = """# Command line

Every command's own `--help`, as click prints it (the test suite checks that this page is
current; `python tests/test_cli_docs.py` writes it again). Options named after a config field
(`--kv-dtype`, `--max-num-seqs` ...) are also keyword arguments of the offline API,
`hetero.LLM(model, kv_dtype="fp16", max_num_seqs=64)`, and keys of the daemon's TOML file
(`hetero-serve --config configs/server.toml`).
"""


def _help(command: click.Command, name: str, parent: click.Context | None) -> str:
    # The command's own context_settings (hetero-serve's -h) are passed as click's make_context
    # would; a bare Context takes them or not depending on click's version.
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    ctx = click.Context(command, info_name=name, parent=parent, **settings)
    return command.get_help(ctx)


def render() -> str:
    from hetero.cli import main
    from hetero.server.app import serve_cli

    parts = [INTRO]
    parts.append(f"## hetero-serve\n\n```text\n{_help(serve_cli, 'hetero-serve', None)}\n```\n")
    top = click.Context(main, info_name="hetero", terminal_width=WIDTH, max_content_width=WIDTH)
    parts.append(f"## hetero\n\n```text\n{main.get_help(top)}\n```\n")
    for name in sorted(main.commands):
        text = _help(main.commands[name], name, top)
        parts.append(f"## hetero {name}\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


def test_docs_cli_is_the_commands_own_help():
    assert PAGE.read_text() == render(), "docs/cli.md is stale: python tests/test_cli_docs.py"


if __name__ == "__main__":
    sys.path.insert(0, str(PAGE.parents[1]))
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
