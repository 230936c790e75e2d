"""The `rankmeter` command's parser and `main`: one subcommand per module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rankmeter import __version__
from rankmeter.cli.common import ServiceError, UsageError
from rankmeter.trec import InputError

SUBCOMMANDS = ("evaluate", "serve", "simulate", "demo", "report", "replay")  # in --help's order


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`only`) one subcommand's: `rankmeter eval` then imports none of
    the service's modules, which is most of its start-up (issue 23)."""
    import importlib

    root = argparse.ArgumentParser(
        prog="rankmeter", description="Streaming online evaluation for search.")
    root.add_argument("--version", action="version", version=f"rankmeter {__version__}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in (only,) if only else SUBCOMMANDS:
        importlib.import_module(f"rankmeter.cli.{name}").add_parser(commands)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser("evaluate" if argv[:1] == ["eval"] else None).parse_args(argv)
    try:
        return args.run_command(args)
    except (InputError, UsageError, ServiceError) as e:
        print(f"rankmeter {args.command}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ServiceError) else 2
    except BrokenPipeError:  # `rankmeter eval ... | head`
        return 0
    except KeyboardInterrupt:
        return 130
