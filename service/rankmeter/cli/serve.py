"""`rankmeter serve`: the live service."""

from __future__ import annotations

import argparse

from rankmeter.cli.common import connect, load_settings


def add_parser(commands: argparse._SubParsersAction) -> None:
    sv = commands.add_parser(
        "serve", help="run the live service: Kafka in, Redis state, Prometheus out",
        description="Consume impressions and feedback from Kafka, join them per query in "
                    "Redis, keep rolling aggregates and export them on /metrics. Settings "
                    "come from --config (or RANKMETER_CONFIG) and RANKMETER_* variables.")
    sv.add_argument("--config", metavar="FILE", help="YAML settings file")
    sv.add_argument("--create-topics", type=int, metavar="PARTITIONS",
                    help="create the impressions, feedback and dead-letter topics with this "
                         "many partitions when they are missing")
    sv.add_argument("--rebuild", action="store_true",
                    help="rebuild partitions whose state Redis lost by re-reading the retained "
                         "topics from the start (without it, such partitions are refused)")
    sv.add_argument("--event-clock", action="store_true",
                    help="for history replays (`rankmeter simulate --history`, bench/alert_quality.py): the "
                         "service's now is the newest Kafka record timestamp consumed, not the wall clock, so "
                         "windows end where the replayed traffic is however fast it is read")
    sv.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> int:
    from rankmeter import logs
    from rankmeter.serve import run as run_service

    settings = load_settings(args)
    logs.configure(settings.log_level)
    store, source = connect(settings, args.create_topics)
    if args.event_clock:
        from rankmeter.clock import EventClock
        from rankmeter.config import duration_ms

        max_future_ms = duration_ms(settings.windows.max_future)
        run_service(settings, source, store, rebuild=args.rebuild, clock=EventClock(max_future_ms=max_future_ms))
    else:
        run_service(settings, source, store, rebuild=args.rebuild)
    return 0
