"""`rankmeter replay`: logged OpenSearch UBI data into Kafka, or evaluated in-process."""

from __future__ import annotations

import argparse
import sys

from rankmeter.cli.common import ServiceError, UsageError, ensure_topics, load_settings, reaching


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    rl.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import msgspec

    from rankmeter import logs
    from rankmeter.config import duration_ms
    from rankmeter.demo import render
    from rankmeter.replay import (KafkaSink, Progress, embedded, iso, load_judgments, open_inputs, outcomes_text,
                                  replay, topic_names)

    settings = load_settings(args)
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
    judgments = load_judgments(args.judgments) if args.judgments else None
    inputs = open_inputs(args.files, args.format)
    show = sys.stderr if args.progress or sys.stderr.isatty() else None
    try:
        if args.embedded:
            summary, result = embedded(settings, inputs, judgments,
                                              lambda label, total: Progress(total, show, label))
            print(summary.text())
            print(outcomes_text(result))
            header = (f"rankmeter replay --embedded — window {window} ending at the last replayed event, "
                      f"{iso(result.now_ms)}")
            print()
            print(render(result.views, window, header, args.baseline))
            failed = None
        else:
            progress = Progress(sum(i.size for i in inputs), show)
            with reaching(settings):
                ensure_topics(settings, args.create_topics)
                sink = KafkaSink(settings)
                summary = replay(inputs, sink, topic_names(settings), judgments, progress)
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
