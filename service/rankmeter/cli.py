"""The `rankmeter` command: `serve`, `demo`, `simulate`, `eval`, `report`, `replay`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rankmeter import __version__
from rankmeter.engine import parse_all
from rankmeter.redaction import redact
from rankmeter.trec import InputError

DEFAULT_MEASURES = ["nDCG@10", "P@10", "AP", "RR", "R@10"]


class UsageError(Exception):
    """A mistake on the command line or in the settings: one line, exit status 2."""


class ServiceError(Exception):
    """A service that cannot be reached at start: one line, exit status 1."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankmeter", description="Streaming online evaluation for search.")
    parser.add_argument("--version", action="version", version=f"rankmeter {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ev = commands.add_parser(
        "eval", help="evaluate a TREC run against TREC qrels (like trec_eval)",
        description="Evaluate a TREC run (qid Q0 docid rank score tag) against TREC qrels "
                    "(qid iter docid grade) with trec_eval's semantics. Documents are ordered "
                    "by score, ties by document id descending, as trec_eval does; only "
                    "queries present in both files are evaluated.")
    ev.add_argument("qrels", metavar="QRELS")
    ev.add_argument("run", metavar="RUN")
    ev.add_argument("-m", "--measure", action="append", metavar="MEASURE",
                    help="a measure in ir_measures notation, e.g. nDCG@10, P@10, AP, "
                         "SetF(beta=0.5); repeatable (default: %s)" % " ".join(DEFAULT_MEASURES))
    ev.add_argument("-l", "--relevance-level", type=float, default=1.0, metavar="N",
                    help="the lowest grade that counts as relevant (trec_eval's -l; default 1)")
    ev.add_argument("-q", "--per-query", action="store_true",
                    help="print every query's values too (trec_eval's -q)")
    ev.add_argument("--average", choices=["macro", "micro"], default="macro",
                    help="the `all` line: mean of per-query values (macro, trec_eval's) or "
                         "summed numerators over summed denominators (micro)")
    ev.add_argument("--format", choices=["tsv", "json"], default="tsv")
    ev.add_argument("--digits", type=int, default=4, metavar="N",
                    help="decimal places in tsv output (default 4, as trec_eval)")
    ev.set_defaults(run_command=_eval)

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
    sv.set_defaults(run_command=_serve)

    sim = commands.add_parser(
        "simulate", help="produce realistic search traffic into Kafka, live or days of history "
                         "(BM25 rankers, click models)",
        description="A synthetic corpus, Zipf-popular queries, users with 30-minute sessions, two "
                    "BM25 rankers of known quality (bm25-tuned better than bm25-degraded), clicks from "
                    "a click model driven by hidden true grades, dwell, add-to-carts, purchases, some "
                    "judgments, duplicates and disorder; feedback seconds (clicks) to minutes "
                    "(purchases) after its impression. Writes to the configured Kafka topics, keyed by "
                    "query_id. Live by default (--rate events per second, timestamps now); with "
                    "--history, days of event time as fast as possible, with daily and weekly cycles.")
    sim.add_argument("--config", metavar="FILE", help="YAML settings file (Kafka and topics)")
    _traffic_options(sim, rate=200.0)
    sim.add_argument("--count", type=int, metavar="N", help="stop after N events")
    sim.add_argument("--split", type=float, default=0.5, metavar="SHARE",
                     help="share of queries answered by bm25-tuned (default 0.5)")
    sim.add_argument("--truth", action="store_true",
                     help="print the true nDCG@10, P@10 and AP per ranker from the hidden grades at the end")
    sim.add_argument("--create-topics", type=int, default=4, metavar="PARTITIONS",
                     help="partitions of the topics it creates when they are missing (default 4; 0: create none)")
    sim.add_argument("--click-model", choices=["pbm", "cascade", "dcm"], default="pbm",
                     help="pbm: position-based, several clicks per query (default); cascade: the first "
                          "attractive result only; dcm: dependent click model, in between")
    sim.add_argument("--regression", action="append", type=_regression, default=[],
                     metavar="RANKER:KIND:SIZE@START/DURATION",
                     help="degrade RANKER from START (an offset from the start, e.g. 90s, 2d14h) for "
                          "DURATION; KIND ranking: with probability SIZE its list is replaced by a "
                          "degraded one; KIND clicks: every result's click attractiveness times 1 - SIZE. "
                          "Repeatable, e.g. bm25-tuned:ranking:0.3@2d14h/2h")
    sim.add_argument("--output", metavar="FILE",
                     help="write the events as JSON lines to FILE ('-': stdout) instead of Kafka")
    hist = sim.add_argument_group(
        "history", "--history generates event time, not live traffic: --rate, --duration, --count "
                   "and --split do not apply, --interleave and --regression-at are refused.")
    hist.add_argument("--history", type=_span, metavar="SPAN",
                      help="the last SPAN of event time ending now (e.g. 6d, 36h), as fast as possible, "
                           "each record's Kafka timestamp its event's; the service takes events up to "
                           "windows.max_past (7d) old")
    hist.add_argument("--peak", action="append", type=_peak, default=[], metavar="RANKER=QUERIES_PER_HOUR",
                      help="a ranker and its queries per hour at the daily peak (20:00 UTC on a weekday; "
                           "04:00 has 25%%, weekends 80%%); repeatable; default bm25-tuned=500 "
                           "bm25-degraded=500. Another name is bm25-tuned under that name (a canary)")
    sim.set_defaults(run_command=_simulate)

    dm = commands.add_parser(
        "demo", help="simulator + live pipeline + /metrics in one process, with a live table",
        description="Runs the simulator into the live pipeline and shows nDCG@10, P@10, AP, CTR "
                    "and abandonment per ranker with the A/B difference, refreshed every second. "
                    "Embedded (in-process bus, in-memory store) unless RANKMETER_KAFKA_BOOTSTRAP_SERVERS "
                    "and RANKMETER_REDIS_URL are set. Ctrl-C stops.")
    dm.add_argument("--config", metavar="FILE", help="YAML settings file")
    _traffic_options(dm, rate=500.0)
    dm.add_argument("--speed", type=float, default=60.0, metavar="X",
                    help="event time runs X times faster than the wall clock, from a day back until it "
                         "reaches now (default 60: a second shows a minute of traffic; 1: real time)")
    dm.set_defaults(run_command=_demo)

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
    rp.set_defaults(run_command=_report)

    rl = commands.add_parser(
        "replay", help="replay logged OpenSearch UBI data into Kafka, or evaluate it in-process (--embedded)",
        description="Reads logged UBI data — OpenSearch bulk ndjson (an action line such as "
                    "{\"index\": {\"_index\": \"ubi_queries\"}} before each record, as the UBI data "
                    "generator's --generate-ndjson and _bulk exports write it), plain ndjson (a query or an "
                    "event per line), or the generator's ubi_queries.csv and ubi_events.csv — and produces "
                    "every record to the impressions topic (queries) or the feedback topic (events), keyed by "
                    "query_id, with its event time as the Kafka timestamp. Bad records are skipped and listed "
                    "by FILE:LINE; the rest goes through. With --embedded: no Kafka, no Redis; the pipeline "
                    "runs in-process and prints the table `rankmeter report` prints.",
        epilog="Windows end at the last replayed event (--embedded). Into a live `rankmeter serve`: a serve "
               "on the wall clock takes event times at most windows.max_past (7d) old; replay older data "
               "into `rankmeter serve --event-clock`, with its own topics, group and Redis prefix. Exit "
               "status 0 when records were produced, even if some were skipped (the summary lists them), or "
               "the files held none; 2 when every record was skipped or a file cannot be read; 1 when Kafka "
               "cannot be reached or refused records.")
    rl.add_argument("files", nargs="+", metavar="FILE", help="bulk ndjson, ndjson or CSV files, in order")
    rl.add_argument("--config", metavar="FILE", help="YAML settings file (Kafka, topics, measures)")
    rl.add_argument("--format", choices=["bulk", "ndjson", "csv"],
                    help="the files' format (default, per file: csv for *.csv, bulk when the first record "
                         "line is a bulk action line, else ndjson; a pipe such as <(zcat x.ndjson.gz) needs it)")
    rl.add_argument("--judgments", metavar="FILE.csv",
                    help="ESCI-style labels (columns query, product_id, esci_label; or user_query, doc_id, "
                         "label): after each query record, a judgment event per labelled product of its "
                         "user_query, graded by evaluation.labels")
    rl.add_argument("--embedded", action="store_true",
                    help="run the pipeline in-process (in-process bus, in-memory store, event clock) and "
                         "print the report table instead of producing to Kafka")
    rl.add_argument("--window", help="with --embedded: the window to show, ending at the last replayed "
                                     "event: a configured one or any duration, e.g. 7d for the UBI data "
                                     "generator's week (default: the largest configured, so a replayed day "
                                     "shows whole)")
    rl.add_argument("--baseline", metavar="RANKER",
                    help="with --embedded: show the other rankers' differences to this one")
    rl.add_argument("--create-topics", type=int, default=4, metavar="PARTITIONS",
                    help="partitions of the topics it creates when they are missing (default 4; 0: create none)")
    rl.add_argument("--progress", action="store_true",
                    help="a progress bar on stderr even when it is not a terminal")
    rl.set_defaults(run_command=_replay)
    return parser


def _traffic_options(parser: argparse.ArgumentParser, rate: float) -> None:
    parser.add_argument("--rate", type=float, default=rate, metavar="EVENTS_PER_S",
                        help=f"events per second (default {rate:g})")
    parser.add_argument("--duration", type=float, metavar="SECONDS", help="stop after this long")
    parser.add_argument("--seed", type=int, default=7, help="corpus and traffic seed (default 7)")
    parser.add_argument("--regression-at", type=float, metavar="SECONDS",
                        help="from this many seconds on, bm25-tuned degrades (to see alerts fire)")
    parser.add_argument("--interleave", type=_ranker_pair, metavar="A,B",
                        help="answer every query with a team-draft interleaving of rankers A and B "
                             "(bm25-tuned, bm25-degraded), attributed as interleaving experiment A-vs-B")


def _ranker_pair(text: str) -> tuple[str, str]:
    from rankmeter.simulator.traffic import DEFAULT_RANKERS

    names = tuple(n.strip() for n in text.split(","))
    known = [r.name for r in DEFAULT_RANKERS]
    if len(names) != 2 or names[0] == names[1] or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"two different rankers of {', '.join(known)}, e.g. {','.join(known)}")
    return names[0], names[1]


def _span(text: str) -> int:
    from rankmeter.config import duration_ms

    try:
        ms = duration_ms(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if ms <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a span longer than 0")
    return ms


def _peak(text: str) -> tuple[str, float]:
    name, _, rate = text.partition("=")
    try:
        value = float(rate)
    except ValueError:
        value = float("nan")
    if not name.strip() or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not RANKER=QUERIES_PER_HOUR with a rate > 0, "
                                         "e.g. bm25-canary=20")
    return name.strip(), value


def _regression(text: str):
    from rankmeter.simulator.history import parse_regression

    try:
        return parse_regression(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _eval(args: argparse.Namespace) -> int:
    from rankmeter.offline import evaluate_files, write_json, write_tsv

    try:
        measures = parse_all(args.measure or DEFAULT_MEASURES)
    except ValueError as e:
        raise UsageError(str(e)) from None
    report = evaluate_files(args.qrels, args.run, measures, args.relevance_level, args.average)
    if args.format == "json":
        write_json(report, sys.stdout, args.per_query)
    else:
        write_tsv(report, sys.stdout, args.per_query, args.digits)
    return 0


def _settings(args: argparse.Namespace):
    from rankmeter import config

    try:
        return config.load(args.config)
    except config.ConfigError as e:
        raise UsageError(str(e)) from None


@contextmanager
def _reaching(settings) -> Iterator[None]:
    """Turns a service that cannot be reached at start into one line (ServiceError)."""
    import redis
    from kafka.errors import KafkaError, KafkaTimeoutError

    from rankmeter.config import ConfigError
    from rankmeter.kafka import KafkaUnreachable, TopicMismatch

    try:
        yield
    except redis.RedisError as e:
        # The whole message: the URL's password, and any a driver error might quote.
        raise ServiceError(redact(f"cannot reach Redis at {settings.redis.url}: {e}")) from None
    except KafkaError as e:
        # kafka-python reports refused credentials and wrong TLS alike, as a bootstrap timeout.
        hint = " (is it up, and do kafka.client's security settings match its listener?)" \
            if isinstance(e, KafkaTimeoutError) else ""
        raise ServiceError(redact(f"cannot reach Kafka at {settings.kafka.bootstrap_servers}: {e}{hint}")) from None
    except KafkaUnreachable as e:  # the confluent backend: librdkafka's reason, as plain text
        raise ServiceError(redact(f"cannot reach Kafka at {settings.kafka.bootstrap_servers}: {e} (is it up, and "
                                  f"do kafka.client's security settings match its listener?)")) from None
    except ConfigError as e:  # kafka.client's settings the confluent backend cannot take, or it is not installed
        raise UsageError(str(e)) from None
    except TopicMismatch as e:
        raise ServiceError(str(e)) from None


def _connect(settings, create_topics: int | None):
    """The real store and source, checked: Redis answers, the topics are co-partitioned."""
    from rankmeter.kafka import open_source
    from rankmeter.redis_store import RedisStore
    from rankmeter.kafka import create_topics as create

    with _reaching(settings):
        store = RedisStore(settings.redis.url, settings.redis.key_prefix, settings.redis.cluster)
        store.ping()
        _check_eviction(settings, store)
        if create_topics:
            create(settings.kafka, create_topics)
        source = open_source(settings.kafka)
        source.check_topics([settings.kafka.impressions_topic, settings.kafka.feedback_topic])
    return store, source


def _check_eviction(settings, store) -> None:
    """A Redis that evicts keys would lose state piecemeal, unnoticed (docs/delivery.md)."""
    import logging

    policy = store.eviction_policy()
    if policy == "noeviction":
        return
    problem = (f"Redis maxmemory-policy is {policy}: it may evict rankmeter's state; set it to noeviction"
               if policy else "cannot read Redis maxmemory-policy (CONFIG not allowed): make sure it is noeviction")
    if policy and settings.redis.eviction_policy_check == "refuse":
        raise ServiceError(f"{problem} (or redis.eviction_policy_check: warn)")
    logging.getLogger("rankmeter.serve").warning(problem)


def _serve(args: argparse.Namespace) -> int:
    from rankmeter import logs
    from rankmeter.serve import run

    settings = _settings(args)
    logs.configure(settings.log_level)
    store, source = _connect(settings, args.create_topics)
    if args.event_clock:
        from rankmeter.clock import EventClock
        from rankmeter.config import duration_ms

        max_future_ms = duration_ms(settings.windows.max_future)
        run(settings, source, store, rebuild=args.rebuild, clock=EventClock(max_future_ms=max_future_ms))
    else:
        run(settings, source, store, rebuild=args.rebuild)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import json
    import logging

    from rankmeter import logs
    from rankmeter.demo import kafka_sender
    from rankmeter.kafka import create_topics
    from rankmeter.simulator.history import file_sender
    from rankmeter.simulator.traffic import Simulator

    settings = _settings(args)
    logs.configure(settings.log_level)
    log = logging.getLogger("rankmeter.simulate")
    if args.history is None and args.peak:
        raise UsageError("--peak needs --history")
    if args.history is not None and (args.interleave or args.regression_at is not None):
        raise UsageError("--interleave and --regression-at are live only; with --history use --peak and --regression")
    try:  # the traffic first: a mistake in it is reported before any connection
        traffic = _history(args) if args.history is not None else Simulator(
            seed=args.seed, split=args.split, regression_at=args.regression_at, interleave=args.interleave,
            click_model=args.click_model, regressions=args.regression)
    except ValueError as e:
        raise UsageError(str(e)) from None
    output = None
    if args.output:
        output = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
        send = file_sender(output)
    else:
        with _reaching(settings):
            if args.create_topics:
                create_topics(settings.kafka, args.create_topics)
            send = kafka_sender(settings, event_timestamps=args.history is not None)
    if args.history is not None:
        summary = _send_history(traffic, send, settings, log)
    else:
        duration = args.duration if args.duration is not None or args.count is not None else 60.0
        sent = traffic.run(send, args.rate, duration=duration, count=args.count,
                           progress=lambda n, t: log.info("progress", extra={"events": n, "seconds": round(t),
                                                                             "per_second": round(n / t)}))
        summary = {"events": sent}
    send.flush()
    if output is not None and output is not sys.stdout:
        output.close()
    if args.truth:
        summary["truth"] = traffic.truth if args.history is not None else traffic.truth.means()
    print(json.dumps(summary), file=sys.stderr if args.output == "-" else sys.stdout)
    return 0


def _history(args: argparse.Namespace):
    import time

    from rankmeter.simulator.history import History

    peaks = dict(args.peak) or {"bm25-tuned": 500.0, "bm25-degraded": 500.0}
    end = int(time.time() * 1000)
    return History(end - args.history, end, peaks, regressions=args.regression, click_model=args.click_model,
                   seed=args.seed)


def _send_history(history, send, settings, log) -> dict:
    """All of it, as fast as it goes, with a progress line every 5 s."""
    import time

    from rankmeter.config import duration_ms

    def iso(ms: int) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))

    span = history.end_ms - history.start_ms
    if span > duration_ms(settings.windows.max_past) - 3_600_000:
        log.warning("the oldest events will be older than windows.max_past when consumed, and invalid; "
                    "use a shorter --history or a larger windows.max_past",
                    extra={"max_past": settings.windows.max_past})
    log.info("history", extra={"start": iso(history.start_ms), "end": iso(history.end_ms),
                               "rankers": {n: {"peak_per_hour": p, **history.rankers[n]._asdict()}
                                           for n, p in history.peaks.items()},
                               "regressions": [r._asdict() for r in history.simulator.regressions]})
    began = reported = time.monotonic()
    sent = 0
    for event in history:
        send(event)
        sent += 1
        if sent % 2000 == 0 and time.monotonic() - reported >= 5:
            reported = time.monotonic()
            log.info("progress", extra={"events": sent, "queries": history.queries,
                                        "event_time": iso(event.timestamp_ms),
                                        "done": round(min(1.0, (event.timestamp_ms - history.start_ms) / span), 3),
                                        "per_second": round(sent / (reported - began))})
    seconds = time.monotonic() - began
    return {"events": sent, "queries": history.queries, "start": iso(history.start_ms), "end": iso(history.end_ms),
            "seconds": round(seconds, 1), "per_second": round(sent / max(seconds, 1e-9))}


def _demo(args: argparse.Namespace) -> int:
    import os

    from rankmeter import logs
    from rankmeter.demo import demo, embedded, kafka_sender

    if not args.speed >= 1:
        raise UsageError(f"--speed {args.speed:g}: at least 1 (real time)")
    settings = _settings(args)
    logs.configure("WARNING")  # the table is the output
    if os.environ.get("RANKMETER_KAFKA_BOOTSTRAP_SERVERS") and os.environ.get("RANKMETER_REDIS_URL"):
        settings = _demo_run(settings)
        store, source = _connect(settings, create_topics=4)
        with _reaching(settings):
            send = kafka_sender(settings)
        mode = f"Kafka {settings.kafka.bootstrap_servers} + Redis"
    else:
        source, store, send = embedded(settings)
        mode = "embedded (in-process bus, in-memory store)"
    demo(settings, source, store, send, mode, args.rate, args.duration, args.regression_at, args.seed,
         interleave=args.interleave, speed=args.speed)
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


def _report(args: argparse.Namespace) -> int:
    import json

    from rankmeter.demo import render
    from rankmeter.pipeline import Pipeline
    from rankmeter.redis_store import RedisStore

    settings = _settings(args)
    window = args.window or settings.windows.sizes[0]
    if window not in settings.windows.sizes:
        raise UsageError(f"--window {window}: the configured windows are {', '.join(settings.windows.sizes)}")
    with _reaching(settings):
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


def _replay(args: argparse.Namespace) -> int:
    import logging

    import msgspec

    from rankmeter import logs, replay
    from rankmeter.config import duration_ms
    from rankmeter.demo import render
    from rankmeter.kafka import create_topics

    settings = _settings(args)
    logs.configure("WARNING")  # the summary (and the table) are the output
    # A Kafka that cannot be reached ends in one line (ServiceError): the client's
    # connection retries, logged on the way, would bury it.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    window = args.window or max(settings.windows.sizes, key=duration_ms)
    if not args.embedded and (args.window or args.baseline):
        raise UsageError("--window and --baseline need --embedded (for what serve stored: rankmeter report)")
    if window not in settings.windows.sizes:
        # The embedded pipeline is this run's own: any window can be one of its windows.
        try:
            duration_ms(window)
        except ValueError as e:
            raise UsageError(f"--window: {e}") from None
        settings = msgspec.structs.replace(
            settings, windows=msgspec.structs.replace(settings.windows, sizes=[*settings.windows.sizes, window]))
    judgments = replay.load_judgments(args.judgments) if args.judgments else None
    inputs = replay.open_inputs(args.files, args.format)
    show = sys.stderr if args.progress or sys.stderr.isatty() else None
    try:
        if args.embedded:
            summary, result = replay.embedded(settings, inputs, judgments,
                                              lambda label, total: replay.Progress(total, show, label))
            print(summary.text())
            print(replay.outcomes_text(result))
            header = (f"rankmeter replay --embedded — window {window} ending at the last replayed event, "
                      f"{replay.iso(result.now_ms)}")
            print()
            print(render(result.views, window, header, args.baseline))
            failed = None
        else:
            progress = replay.Progress(sum(i.size for i in inputs), show)
            with _reaching(settings):
                if args.create_topics:
                    create_topics(settings.kafka, args.create_topics)
                sink = replay.KafkaSink(settings)
                summary = replay.replay(inputs, sink, replay.topic_names(settings), judgments, progress)
                progress.close()
                sink.close()
            failed = sink.failed
            print(summary.text(failed))
    finally:
        for i in inputs:
            i.close()
    if failed:
        raise ServiceError(f"Kafka refused {sum(failed.values()):,} records ({sink.error})")
    if summary.skipped and not sum(summary.produced.values()):
        raise UsageError(f"every record was skipped ({summary.skipped:,}): nothing produced")
    return 0


def _report_ab(args: argparse.Namespace, settings, pipeline, store) -> int:
    import json

    from rankmeter.ab import report

    if not settings.ab.baseline:
        raise UsageError("no experiment configured: set ab.baseline (RANKMETER_AB_BASELINE)")
    with _reaching(settings):
        look = pipeline.ab_look(save=False)  # read only: the running service keeps the state
        history = store.looks(look.experiment) if look else []
    if look is None:
        raise UsageError(f"no experiment data in Redis for baseline {settings.ab.baseline!r} yet")
    alpha = settings.ab.alpha
    if args.format == "json":
        print(json.dumps({"experiment": look.experiment, "baseline": look.baseline, "srm": look.srm,
                          "arms": [a._asdict() for a in look.arms],
                          "comparisons": [{**c._asdict(), "estimate": c.estimate._asdict(),
                                           "running": c.running._asdict(), "verdict": report.verdict(c, look, alpha)}
                                          for c in look.comparisons]}, indent=1))
    else:
        print(report.table(look, alpha))
    if args.html:
        try:
            text = report.page(look, history, alpha, pipeline.ab_layout.names)
        except ImportError:
            raise UsageError("--html needs matplotlib: pip install 'rankmeter[report]'") from None
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run_command(args)
    except (InputError, UsageError, ServiceError) as e:
        print(f"rankmeter {args.command}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ServiceError) else 2
    except BrokenPipeError:  # `rankmeter eval ... | head`
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
