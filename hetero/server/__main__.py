"""`python -m hetero.server`: the same as the `hetero-serve` command."""

from __future__ import annotations

from hetero.server.app import serve_cli

if __name__ == "__main__":
    serve_cli(prog_name="hetero-serve")
