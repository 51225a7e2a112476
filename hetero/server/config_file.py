"""`hetero-serve --config server.toml`: the command's options from a TOML table.

Keys are the options' names (`num_kv_blocks` or `num-kv-blocks`), plus `model`. A key the command
does not have is an error, and every value is checked by the option's own type (ranges and choices
included), so a file can never set what a flag could not. Flags given on the command line win.
"""

from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library
    tomllib = None  # type: ignore[assignment]


def _kind_ok(param: click.Parameter, value: Any) -> bool:
    """TOML already types its values: require the one the option takes (no "8" for 8); a
    repeatable option takes an array of them."""
    if getattr(param, "multiple", False):
        if not isinstance(value, list):
            return False
        single = click.Option(["--x"], type=param.type)
        return all(_kind_ok(single, v) for v in value)
    t = param.type
    kinds = getattr(t, "toml_kinds", None)  # an option's own type that takes several
    if kinds is not None:
        return isinstance(value, kinds) and not isinstance(value, bool)
    if isinstance(t, click.types.BoolParamType):
        return isinstance(value, bool)
    if isinstance(t, click.types.IntParamType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, click.types.FloatParamType):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def read_table(path: str) -> dict[str, Any]:
    if tomllib is None:
        raise click.UsageError("--config needs Python 3.11 or newer (the tomllib module)")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise click.UsageError(f"{path}: not valid TOML: {e}") from e


def apply_config(ctx: click.Context, values: dict[str, Any], path: str) -> dict[str, Any]:
    """`values` with the file's settings for every option left at its default."""
    params = {p.name: p for p in ctx.command.params if p.name != "config_path"}
    out = dict(values)
    for raw_key, value in read_table(path).items():
        key = raw_key.replace("-", "_")
        param = params.get(key)
        if param is None:
            known = ", ".join(sorted(params))
            raise click.UsageError(f"{path}: unknown key {raw_key!r}; known keys: {known}")
        if not _kind_ok(param, value):
            raise click.UsageError(
                f"{path}: {raw_key} = {value!r} has the wrong type (expected {param.type.name})"
            )
        try:
            converted = param.type_cast_value(ctx, value)
        except click.BadParameter as e:
            raise click.UsageError(f"{path}: {raw_key}: {e.message}") from e
        if ctx.get_parameter_source(key) in (None, ParameterSource.DEFAULT):
            out[key] = converted
    return out
