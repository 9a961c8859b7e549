"""How the ``gradfleet`` command parses and shows itself, on typer's classes: a parsing error
(a missing option, a value of the wrong type, an unknown command or flag) is one ``error:``
line with exit code 2, as every other bad input is, instead of click's usage box; and a flag
shows no value type in ``--help`` (typer writes ``--help <bool>``)."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

__all__ = ["Command", "Group", "error_line"]

err_console = Console(stderr=True)


def error_line(message: str) -> None:
    """Bad input's one line on stderr."""
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)


def _click_error(name: str) -> type[Exception]:
    """Click's exception class ``name``, of the click typer uses (its own copy since 0.2x)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_USAGE_ERROR, _CLICK_ERROR = _click_error("UsageError"), _click_error("ClickException")


def _plain_help_option(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # a flag: no value to name
    return option


class Command(TyperCommand):
    """A command whose ``--help`` flag shows no value type."""

    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help_option(super().get_help_option(ctx))


class Group(TyperGroup):
    """The command group: its parsing errors, and its commands', are one ``error:`` line."""

    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help_option(super().get_help_option(ctx))

    def main(  # type: ignore[override]
        self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
        standalone_mode: bool = True, **extra: Any,
    ) -> Any:  # fmt: skip
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _CLICK_ERROR as err:
            ctx = getattr(err, "ctx", None) if isinstance(err, _USAGE_ERROR) else None
            where = f" (see {ctx.command_path} --help)" if ctx else ""
            error_line(err.format_message().rstrip(".") + where)  # type: ignore[attr-defined]
            code = err.exit_code  # type: ignore[attr-defined]
        except typer.Abort:
            error_line("aborted")
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)
