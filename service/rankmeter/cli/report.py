"""`rankmeter report`: the current aggregates (or the A/B experiment) from Redis."""

from __future__ import annotations

import argparse

from rankmeter.cli.common import UsageError, load_settings, reaching
from rankmeter.redaction import redact


def add_parser(commands: argparse._SubParsersAction) -> None:
    rp = commands.add_parser(
        "report", help="print the current aggregates from Redis (no Kafka, no Prometheus needed)",
        description="Reads the window buckets every partition stored in Redis and prints each "
                    "ranker's measures for one window, or every series as JSON.")
    rp.add_argument("--config", metavar="FILE", help="YAML settings file (Redis and measures)")
    rp.add_argument("--window", help="the window to show (default: the smallest configured)")
    rp.add_argument("--baseline", metavar="RANKER", help="show the other rankers' differences to this one")
    rp.add_argument("--format", choices=["table", "json"], default="table")
    rp.add_argument("--ab", action="store_true",
                    help="the A/B experiment instead: per treatment and measure the delta, its always-valid "
                         "confidence sequence and p-value, judged shares, sample-ratio check and a verdict")
    rp.add_argument("--html", metavar="FILE",
                    help="with --ab: also write a self-contained HTML report with plots to FILE")
    rp.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> int:
    import json

    from rankmeter.demo import render
    from rankmeter.pipeline import Pipeline
    from rankmeter.redis_store import RedisStore

    settings = load_settings(args)
    window = args.window or settings.windows.sizes[0]
    if window not in settings.windows.sizes:
        raise UsageError(f"--window {window}: the configured windows are {', '.join(settings.windows.sizes)}")
    with reaching(settings):
        store = RedisStore(settings.redis.url, settings.redis.key_prefix, settings.redis.cluster)
        store.ping()  # also refuses a cluster node without redis.cluster: it would report a third
        pipeline = Pipeline(settings, store, dead_letter=lambda record, reason: None)
        pipeline.assign(store.partitions(), claim=False)  # read-only: loads the stored buckets
    if args.ab:
        return _report_ab(args, settings, pipeline, store)
    views = pipeline.views()
    if args.format == "json":
        print(json.dumps([{**v._asdict(), "sums": {m: s._asdict() for m, s in v.sums.items()}}
                          for v in views if v.window == window], indent=1))
    else:
        header = f"rankmeter report — {redact(settings.redis.url)} — window {window} — {len(pipeline.partitions)} partitions"
        print(render(views, window, header, args.baseline))
    return 0


def _report_ab(args: argparse.Namespace, settings, pipeline, store) -> int:
    import json

    from rankmeter.ab import report

    if not settings.ab.baseline:
        raise UsageError("no experiment configured: set ab.baseline (RANKMETER_AB_BASELINE)")
    with reaching(settings):
        look = pipeline.ab_look(save=False)  # read only: the running service keeps the state
        history = store.looks(look.experiment) if look else []
    if look is None:
        raise UsageError(f"no experiment data in Redis for baseline {settings.ab.baseline!r} yet")
    alpha = settings.ab.alpha
    if args.format == "json":
        print(json.dumps({"experiment": look.experiment, "baseline": look.baseline, "split": look.split, "unit": look.unit,
                          "since_ms": look.since_ms, "notes": list(look.notes), "srm": look.srm,
                          "arms": [a._asdict() for a in look.arms],
                          "comparisons": [{**c._asdict(), "estimate": c.estimate._asdict(),
                                           "running": c.running._asdict(), "verdict": report.verdict(c, look, alpha),
                                           "tests": {k: r._asdict() for k, r in c.tests.items()},
                                           # ab.cuped; null: not adjusted (JSON has no NaN)
                                           "variance_reduction": c.variance_reduction
                                           if c.variance_reduction == c.variance_reduction else None}
                                          for c in look.comparisons],
                          "decisions": report.decisions_json(look)}, indent=1))
    else:
        print(report.table(look, alpha))
    if args.html:
        try:
            text = report.page(look, history, alpha, pipeline.ab_layout.names, pipeline.unreadable)
        except ImportError:
            raise UsageError("--html needs matplotlib: pip install 'rankmeter[report]'") from None
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(text)
    return 0
