"""The `shuili` command. Each subcommand lives beside what it drives and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module path -> it defines add_parser(subparsers); each parser sets `func(args) -> int`
SUBCOMMANDS = (
    "shuili.hal.cli",
    "shuili.core.cli",
    "shuili.core.server.cli",
    "shuili.conformance.cli",
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends each flag's default unless it is "not given" or the help already says it; keeps
    epilogs' line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == []
        if unset or action.default is argparse.SUPPRESS or "default" in text or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every subcommand's parser (nested ones inherit the class), so every --help shows defaults."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shuili", description="DeepSeek-V4 inference on a pluggable hardware abstraction layer")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # user-facing errors: one line, no traceback unless -vv
        from shuili.core.errors import describe
        from shuili.hal import HALError

        known = (HALError, ValueError, FileNotFoundError)
        if isinstance(exc, known) and args.verbose < 2:
            for line in describe(exc).splitlines():
                print(f"shuili: error: {line}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
