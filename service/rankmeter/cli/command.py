"""The `rankmeter` command's parser and `main`: one subcommand per module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rankmeter import __version__
from rankmeter.cli import demo, evaluate, replay, report, serve, simulate
from rankmeter.cli.common import ServiceError, UsageError
from rankmeter.trec import InputError


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="rankmeter", description="Streaming online evaluation for search.")
    root.add_argument("--version", action="version", version=f"rankmeter {__version__}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for subcommand in (evaluate, serve, simulate, demo, report, replay):  # in --help's order
        subcommand.add_parser(commands)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run_command(args)
    except (InputError, UsageError, ServiceError) as e:
        print(f"rankmeter {args.command}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ServiceError) else 2
    except BrokenPipeError:  # `rankmeter eval ... | head`
        return 0
    except KeyboardInterrupt:
        return 130
