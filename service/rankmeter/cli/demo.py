"""`rankmeter demo`: the simulator into the live pipeline, with a live table."""

from __future__ import annotations

import argparse

from rankmeter.cli.common import UsageError, connect, load_settings, reaching
from rankmeter.cli.simulate import traffic_options


def add_parser(commands: argparse._SubParsersAction) -> None:
    dm = commands.add_parser(
        "demo", help="simulator + live pipeline + /metrics in one process, with a live table",
        description="Runs the simulator into the live pipeline and shows nDCG@10, P@10, AP, CTR "
                    "and abandonment per ranker with the A/B difference, refreshed every second. "
                    "Embedded (in-process bus, in-memory store) unless RANKMETER_KAFKA_BOOTSTRAP_SERVERS "
                    "and RANKMETER_REDIS_URL are set. Ctrl-C stops.")
    dm.add_argument("--config", metavar="FILE", help="YAML settings file")
    traffic_options(dm, rate=500.0)
    dm.add_argument("--count", type=int, metavar="N",
                    help="stop after N events (and once they are all read), however long that takes")
    dm.add_argument("--speed", type=float, default=60.0, metavar="X",
                    help="event time runs X times faster than the wall clock, from a day back until it "
                         "reaches now (default 60: a second shows a minute of traffic; 1: real time)")
    dm.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> int:
    import os

    from rankmeter import logs
    from rankmeter.demo import demo, embedded, kafka_sender

    if not args.speed >= 1:
        raise UsageError(f"--speed {args.speed:g}: at least 1 (real time)")
    settings = load_settings(args)
    logs.configure("WARNING")  # the table is the output
    if os.environ.get("RANKMETER_KAFKA_BOOTSTRAP_SERVERS") and os.environ.get("RANKMETER_REDIS_URL"):
        settings = _demo_run(settings)
        store, source = connect(settings, create_topics=4)
        with reaching(settings):
            send = kafka_sender(settings)
        mode = f"Kafka {settings.kafka.bootstrap_servers} + Redis"
    else:
        source, store, send = embedded(settings)
        mode = "embedded (in-process bus, in-memory store)"
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count {args.count}: at least 1")
    demo(settings, source, store, send, mode, args.rate, args.duration, args.regression_at, args.seed,
         interleave=args.interleave, speed=args.speed, count=args.count)
    return 0


def _demo_run(settings):
    """A demo on real services gets its own topics, group and Redis prefix: its event time
    starts a day back, and a previous run's stored watermarks (or its events) would close
    or mix with this run's queries."""
    import os

    import msgspec

    run_id = f"demo-{os.urandom(3).hex()}"
    k = settings.kafka
    kafka = msgspec.structs.replace(k, group_id=f"{k.group_id}.{run_id}",
                                    impressions_topic=f"{k.impressions_topic}.{run_id}",
                                    feedback_topic=f"{k.feedback_topic}.{run_id}",
                                    dead_letter_topic=f"{k.dead_letter_topic}.{run_id}")
    redis = msgspec.structs.replace(settings.redis, key_prefix=f"{settings.redis.key_prefix}.{run_id}")
    return msgspec.structs.replace(settings, kafka=kafka, redis=redis)
