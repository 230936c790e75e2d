"""`rankmeter simulate`: synthetic search traffic into Kafka (or a file), live or days of history."""

from __future__ import annotations

import argparse
import sys

from rankmeter.cli.common import UsageError, ensure_topics, load_settings, reaching


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    traffic_options(sim, rate=200.0)
    sim.add_argument("--count", type=int, metavar="N", help="stop after N events")
    sim.add_argument("--split", type=float, default=0.5, metavar="SHARE",
                     help="share of queries answered by bm25-tuned (default 0.5)")
    sim.add_argument("--assign", choices=["query", "user"], default="query",
                     help="query: each query's ranker drawn with --split (default); user: sticky per-user "
                          "assignment, a user's ranker fixed by a hash of their client_id and --split")
    sim.add_argument("--user-sigma", type=float, default=None, metavar="SIGMA",
                     help="σ of the users' click propensity (lognormal, mean 1; default 0.3): how unlike "
                          "one user's clicks are another's")
    sim.add_argument("--persistence", type=float, default=None, metavar="P",
                     help="persistent query-text difficulty, 0 to 1: the share of a query's click-level "
                          "variation its text carries at every query (CUPED's covariate); default: none")
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
    sim.set_defaults(run_command=run)


def traffic_options(parser: argparse.ArgumentParser, rate: float) -> None:
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


def run(args: argparse.Namespace) -> int:
    import json
    import logging

    from rankmeter import logs
    from rankmeter.demo import kafka_sender
    from rankmeter.simulator.history import file_sender
    from rankmeter.simulator.traffic import Simulator

    settings = load_settings(args)
    logs.configure(settings.log_level)
    log = logging.getLogger("rankmeter.simulate")
    if args.history is None and args.peak:
        raise UsageError("--peak needs --history")
    if args.history is not None and (args.interleave or args.regression_at is not None):
        raise UsageError("--interleave and --regression-at are live only; with --history use --peak and --regression")
    if args.history is not None and (args.assign != "query" or args.user_sigma is not None
                                     or args.persistence is not None):
        raise UsageError("--assign, --user-sigma and --persistence are live only")
    users = {} if args.user_sigma is None else {"user_sigma": args.user_sigma}
    if args.persistence is not None:
        users["persistence"] = args.persistence
    try:  # the traffic first: a mistake in it is reported before any connection
        traffic = _history(args) if args.history is not None else Simulator(
            seed=args.seed, split=args.split, regression_at=args.regression_at, interleave=args.interleave,
            click_model=args.click_model, regressions=args.regression, assign=args.assign, **users)
    except ValueError as e:
        raise UsageError(str(e)) from None
    output = None
    if args.output:
        output = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
        send = file_sender(output)
    else:
        with reaching(settings):
            ensure_topics(settings, args.create_topics)
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
