"""Prometheus exposition: a custom collector that reads the pipeline's aggregates at
scrape time (nothing is recomputed per event), served by prometheus_client's own WSGI
app (the text format or OpenMetrics as the scraper asks, gzip when it accepts it) beside
/healthz and /readyz, on a threading WSGI server.

Metric names and labels are the contract of brief §6; `promtool check metrics` is
clean on the output (tests/integration/test_serve.py checks it).
"""

from __future__ import annotations

import gzip
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                   Metric)
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted

from rankmeter import exposition
from rankmeter.ab import export as ab_export
from rankmeter.debias.fit import REASONS, Look
from rankmeter.pipeline import IPW
from rankmeter.pipeline.readout import Readout
from rankmeter.windows import BIN_EDGES

log = logging.getLogger("rankmeter.exporter")


class Health:
    """What /healthz and /readyz answer: alive while the loop beats, ready once assigned
    and while nothing is wrong: the store away, the broker away, partitions whose state is lost."""

    def __init__(self, stale_after_s: float = 60.0) -> None:
        self.last_beat = time.monotonic()
        self.ready = False
        self.store_problem = ""
        self.lost_problem = ""
        self.source_problem = ""
        self.stale_after_s = stale_after_s

    @property
    def problem(self) -> str:
        return "; ".join(p for p in (self.store_problem, self.source_problem, self.lost_problem) if p)

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    @property
    def alive(self) -> bool:
        return time.monotonic() - self.last_beat < self.stale_after_s


class PipelineCollector:
    def __init__(self, readout: Readout, lag: Callable[[], dict[tuple[str, int], int]],
                 lag_seconds: Callable[[], dict[tuple[str, int], float]] = dict) -> None:
        self.readout = readout
        self.lag = lag
        self.lag_seconds = lag_seconds

    def collect(self) -> Iterator[Metric]:
        labels = ["metric", "ranker", "segment", "window", "average"]
        quality = GaugeMetricFamily(
            "rankmeter_quality", "Ranking quality per ranker and window: macro = mean of "
            "per-query values, micro = summed numerators over summed denominators.", labels=labels)
        numerator = GaugeMetricFamily(
            "rankmeter_quality_numerator", "Numerator of rankmeter_quality (macro: sum of "
            "per-query values; micro: sum of per-query numerators).", labels=labels)
        denominator = GaugeMetricFamily(
            "rankmeter_quality_denominator", "Denominator of rankmeter_quality (macro: queries "
            "averaged; micro: sum of per-query denominators).", labels=labels)
        queries = GaugeMetricFamily(
            "rankmeter_queries", "Queries in the window: all, and judged (a relevant document known).",
            labels=["ranker", "segment", "window", "population"])
        squares = GaugeMetricFamily(
            "rankmeter_quality_squares", "Sum of squared per-query values over the queries of "
            "rankmeter_quality{average=\"macro\"}: with the numerator and denominator it gives "
            "the variance behind an A/B confidence interval.",
            labels=["metric", "ranker", "segment", "window"])
        distribution = GaugeHistogramMetricFamily(
            "rankmeter_query_quality", "Distribution of the per-query values averaged in "
            "rankmeter_quality{average=\"macro\"}: queries with a value at most `le`.",
            labels=["metric", "ranker", "segment", "window"])
        debiased_labels = ["metric", "grading", "ranker", "segment", "window", "average"]
        debiased = GaugeMetricFamily(
            "rankmeter_debiased_quality", "Ranking quality from position-bias-corrected click "
            "grades (grading=\"ipw\": inverse propensity weighted, clipped), beside rankmeter_quality.",
            labels=debiased_labels)
        debiased_numerator = GaugeMetricFamily(
            "rankmeter_debiased_quality_numerator", "Numerator of rankmeter_debiased_quality.",
            labels=debiased_labels)
        debiased_denominator = GaugeMetricFamily(
            "rankmeter_debiased_quality_denominator", "Denominator of rankmeter_debiased_quality.",
            labels=debiased_labels)
        views = self.readout.views()
        for view in views:
            base = [view.ranker, view.segment, view.window]
            for metric, counts in view.distributions.items():
                buckets = list(zip(BIN_EDGES, itertools.accumulate(counts)))
                distribution.add_metric([metric, *base], buckets, gsum_value=view.sums[metric].value_sum)
            queries.add_metric(base + ["all"], view.queries_all)
            queries.add_metric(base + ["judged"], view.queries_judged)
            for metric, s in view.sums.items():
                if metric.startswith(IPW):
                    for average, num, den in (("macro", s.value_sum, s.count), ("micro", s.numerator, s.denominator)):
                        key = [metric[len(IPW):], "ipw", view.ranker, view.segment, view.window, average]
                        debiased_numerator.add_metric(key, num)
                        debiased_denominator.add_metric(key, den)
                        if den:
                            debiased.add_metric(key, num / den)
                    continue
                for average, num, den in (("macro", s.value_sum, s.count), ("micro", s.numerator, s.denominator)):
                    key = [metric, view.ranker, view.segment, view.window, average]
                    numerator.add_metric(key, num)
                    denominator.add_metric(key, den)
                    if den:  # no value rather than NaN when nothing is averaged yet
                        quality.add_metric(key, num / den)
                squares.add_metric([metric, *base], s.value_squares)
        yield from (quality, numerator, denominator, squares, queries, distribution)
        if self.readout.debiased:
            look = self.readout.click_fit() if self.readout.click_fit is not None else None
            if look is not None and not look.valid:
                # Withdrawn while the fit test fails (debias/fit.py): the families, no series.
                debiased, debiased_numerator, debiased_denominator = (
                    GaugeMetricFamily(f.name, f.documentation, labels=debiased_labels)
                    for f in (debiased, debiased_numerator, debiased_denominator))
            yield from (debiased, debiased_numerator, debiased_denominator, *self._propensities())
            if look is not None:
                yield from click_fit_metrics(look)
        yield self._ranker_info(sorted({v.ranker for v in views}))

        events = CounterMetricFamily("rankmeter_events", "Events consumed, by stream and outcome.",
                                     labels=["stream", "outcome"])
        for (stream, outcome), n in sorted(dict(self.readout.events).items()):  # dict(): one C-level copy
            events.add_metric([stream, outcome], n)
        yield events
        folded = CounterMetricFamily("rankmeter_labels_folded",
                                     "Ranker or segment values folded into `other` by the cap (experiment: "
                                     "interleaving experiments not counted).",
                                     labels=["label"])
        for kind in ("ranker", "segment", "experiment"):
            folded.add_metric([kind], self.readout.folded[kind])
        yield folded
        unreadable = CounterMetricFamily("rankmeter_store_unreadable", "Stored fields skipped because this "
                                         "version cannot read them (logged once each), by kind.", labels=["kind"])
        for kind, n in sorted(dict(self.readout.unreadable).items()):
            unreadable.add_metric([kind], n)
        yield unreadable
        lag = GaugeMetricFamily("rankmeter_consumer_lag", "Records behind the end of each "
                                "assigned partition.", labels=["topic", "partition"])
        for (topic, partition), n in sorted(self.lag().items()):
            lag.add_metric([topic, str(partition)], n)
        yield lag
        lag_seconds = GaugeMetricFamily("rankmeter_consumer_lag_seconds", "Event time the consumer is behind "
                                        "on each assigned partition: 0 when caught up, else now minus the "
                                        "newest record consumed.", labels=["topic", "partition"])
        for (topic, partition), seconds in sorted(self.lag_seconds().items()):
            lag_seconds.add_metric([topic, str(partition)], seconds)
        yield lag_seconds
        yield GaugeMetricFamily("rankmeter_open_queries", "Queries still open for feedback "
                                "(held in the state store).", value=self.readout.open_queries())
        yield GaugeMetricFamily("rankmeter_assigned_partitions", "Partitions this process holds.",
                                value=self.readout.held())
        lost = GaugeMetricFamily("rankmeter_state_lost", "1 for a partition whose stored state is "
                                 "gone while Kafka has consumed it: not consumed until `rankmeter "
                                 "serve --rebuild`.", labels=["partition"])
        for p in sorted(self.readout.lost):
            lost.add_metric([str(p)], 1)
        yield lost
        yield from self._losses()
        yield CounterMetricFamily("rankmeter_partitions_fenced", "Checkpoints refused because another "
                                  "replica had claimed the partition (this one had stalled).",
                                  value=self.readout.fenced_total())
        yield from self._experiment()  # last: it returns early without an experiment

    def _losses(self) -> Iterator[Metric]:
        """Writes the store lost and offsets gone backwards (pipeline/offsets.py)."""
        lost = CounterMetricFamily("rankmeter_checkpoints_lost", "Times the state store was found to have "
                                   "lost a partition's last checkpoints (restored from an older copy, failed "
                                   "over to a replica behind): resumed from the last it holds.",
                                   labels=["partition"])
        for p, n in sorted(dict(self.readout.checkpoints_lost).items()):
            lost.add_metric([str(p)], n)
        yield lost
        reset = CounterMetricFamily("rankmeter_offsets_reset", "Times a partition's stored offset was found "
                                    "outside Kafka's log: cause recreated (the log ends below it) or truncated "
                                    "(it starts above it).", labels=["topic", "partition", "cause"])
        for (topic, p, cause), n in sorted(dict(self.readout.offsets_reset).items()):
            reset.add_metric([topic, str(p), cause], n)
        yield reset
        skipped = CounterMetricFamily("rankmeter_offsets_skipped", "Offsets no longer in Kafka's log, skipped "
                                      "when resuming from the new log (kafka.on_offsets_reset: resume).",
                                      labels=["topic", "partition"])
        for (topic, p), n in sorted(dict(self.readout.offsets_skipped).items()):
            skipped.add_metric([topic, str(p)], n)
        yield skipped
        yield CounterMetricFamily("rankmeter_ab_running_lost", "Looks at the A/B experiment that found its stored "
                                  "running statistics older than this process last saved (carried on from memory).",
                                  value=self.readout.ab_running_lost())
        yield CounterMetricFamily("rankmeter_ab_units_missing", "Impressions of an experiment by user (ab.unit: "
                                  "user) without a client_id: no user to assign, left out of the experiment.",
                                  value=self.readout.ab_units_missing())

    def _propensities(self) -> Iterator[Metric]:
        found = self.readout.propensities()
        relative = GaugeMetricFamily(
            "rankmeter_propensity", "Estimated probability that a user examines each rank, relative "
            "to rank 1 (intervention harvesting across rankers): the weights of the debiased measures.",
            labels=["rank"])
        support = GaugeMetricFamily(
            "rankmeter_propensity_pairs", "Harvested (query, document) pairs shown at each rank and at "
            "another: the evidence behind rankmeter_propensity (an estimate needs debias.min_pairs).",
            labels=["rank"])
        for rank, (p, n) in enumerate(zip(found.relative, found.support), start=1):
            if p is not None:
                relative.add_metric([str(rank)], p)
            support.add_metric([str(rank)], n)
        yield from (relative, support)
        own = GaugeMetricFamily(
            "rankmeter_propensity_segment_curve", "1 for a segment whose debiased measures are weighed by its "
            "own examination curve (its harvest has debias.segment_min_pairs pairs at every rank), 0 for one "
            "harvested that uses the global curve.", labels=["segment"])
        for segment, has in self.readout.segment_curves().items():
            own.add_metric([segment], float(has))
        yield own
        yield CounterMetricFamily("rankmeter_propensity_harvested_queries", "Queries harvested into the click "
                                  "models by this process (their clicks final): whether the harvest runs.",
                                  value=self.readout.harvested())

    def _ranker_info(self, rankers: list[str]) -> Metric:
        production = self.readout.production_rankers
        info = GaugeMetricFamily("rankmeter_ranker_info", "1 per ranker exported; role=\"production\" for "
                                 "alerts.production_rankers (every ranker when that is empty): their quality "
                                 "alerts page, the others' warn.", labels=["ranker", "role"])
        for ranker in rankers:
            info.add_metric([ranker, "production" if not production or ranker in production else "candidate"], 1)
        return info

    def _interleaving(self) -> Iterator[Metric]:
        labels = ["experiment", "ranker_a", "ranker_b"]
        queries = GaugeMetricFamily(
            "rankmeter_interleaving_queries", "Interleaved queries with a click since the experiment began, by "
            "outcome: the ranker whose team got more clicks, or tie. A gauge, not a counter: a later click can "
            "change a query's outcome.", labels=["experiment", "outcome"])
        preference = GaugeMetricFamily(
            "rankmeter_interleaving_preference", "Team-draft preference (wins of ranker_a - wins of ranker_b) / "
            "(wins + ties): above 0, ranker_a is preferred.", labels=labels)
        p_value = GaugeMetricFamily(
            "rankmeter_interleaving_p_value", "Always-valid p-value for a preference != 0 (mSPRT, running "
            "minimum).", labels=labels)
        for r in self.readout.interleaving_result():
            for outcome, n in ((r.team_a, r.wins_a), (r.team_b, r.wins_b), ("tie", r.ties)):
                queries.add_metric([r.experiment, outcome], n)
            if math.isfinite(r.estimate.delta):
                preference.add_metric([r.experiment, r.team_a, r.team_b], r.estimate.delta)
            if r.running is not None:
                p_value.add_metric([r.experiment, r.team_a, r.team_b], r.running.p_value)
        yield from (queries, preference, p_value)

    def _experiment(self) -> Iterator[Metric]:
        yield from self._interleaving()
        result = self.readout.ab_result()
        if result is None:
            return
        yield from ab_export.experiment_metrics(result)


def click_fit_metrics(look: Look) -> Iterator[Metric]:
    """Whether the debiased series are exported and why (1 for the current reason, 0 for the
    others, so a dashboard sees every reason), and each click model's held-out perplexity."""
    valid = GaugeMetricFamily(
        "rankmeter_debias_valid", "1 for the reason the debiased series are exported (ok) or withdrawn "
        "(insufficient_support, implausible_propensities, poor_fit, click_reactive_ranker, "
        "unexamined_below_clicks, dependent_clicks), 0 for the others.",
        labels=["reason"])
    for reason in REASONS:
        valid.add_metric([reason], float(reason == look.reason))
    perplexity = GaugeMetricFamily(
        "rankmeter_click_model_perplexity", "Held-out conditional click perplexity of each click model (1 is "
        "perfect, lower is better): each rank's click given the clicks above it, on the harvested queries "
        "held out of the estimate.", labels=["model"])
    chosen = GaugeMetricFamily(
        "rankmeter_click_model_chosen", "1 for the click model whose examination probabilities weigh the "
        "debiased series, 0 for the others.", labels=["model"])
    for model, value in look.perplexity.items():
        chosen.add_metric([model], float(model == look.model))
        if value is not None and math.isfinite(value):  # (a stored sum that is not a number: none)
            perplexity.add_metric([model], value)
    yield from (valid, perplexity, chosen)
    if look.at > 0:  # (an estimate stored by an older version has no time)
        yield GaugeMetricFamily(
            "rankmeter_click_model_estimated_timestamp_seconds", "When partition 0's holder estimated the "
            "click models in use (Unix time): an old one means that replica is not looking.", value=look.at)


class Exporter:
    def __init__(self, readout: Readout, health: Health,
                 lag: Callable[[], dict[tuple[str, int], int]],
                 lag_seconds: Callable[[], dict[tuple[str, int], float]] = dict) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(PipelineCollector(readout, lag, lag_seconds))
        self.batch_duration = Histogram(
            "rankmeter_batch_duration_seconds", "Time to process one poll batch, end to end.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, math.inf),
            registry=self.registry)
        self.batch_records = Histogram(
            "rankmeter_batch_records", "Records in one poll batch.",
            buckets=(1, 10, 100, 500, 1000, 2500, 5000, 10000, math.inf), registry=self.registry)
        self.health = health
        self._metrics = make_wsgi_app(self.registry)
        self._server: ThreadingWSGIServer | None = None

    def render(self) -> bytes:
        """The text format, as a scrape gets it."""
        return exposition.render(self.registry.collect(), openmetrics=False) or generate_latest(self.registry)

    def _scrape(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """/metrics: what prometheus_client's app answers, written by `exposition.render`
        where it can (a GET in the text format or OpenMetrics 1.0.0, without `name[]`)."""
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        openmetrics = exposition.format_of(encoder)
        if (environ.get("REQUEST_METHOD") == "GET" and openmetrics is not None
                and "name[]" not in parse_qs(environ.get("QUERY_STRING", ""))):
            body = exposition.render(self.registry.collect(), openmetrics)
            if body is not None:
                headers = [("Content-Type", content_type)]
                if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                    body = gzip.compress(body)
                    headers.append(("Content-Encoding", "gzip"))
                start_response("200 OK", headers)
                return [body]
        return self._metrics(environ, start_response)

    def app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """The WSGI app: /metrics is prometheus_client's (text or OpenMetrics as the scraper
        asks, gzip when it accepts it; see `_scrape`), /healthz and /readyz are the probes. Its `?name[]=`
        filter does not reach PipelineCollector's families: the collector has no
        `describe()`, so the registry does not know their names."""
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._scrape(environ, start_response)
        if path == "/healthz":
            ok = self.health.alive
            status, body = (200, b"ok\n") if ok else (503, b"stalled\n")
        elif path == "/readyz":
            health = self.health
            ok = health.ready and health.alive and not health.problem
            status, body = (200, b"ready\n") if ok else (503, f"not ready: {health.problem or 'starting'}\n".encode())
        else:
            status, body = 404, b"not found: try /metrics, /healthz or /readyz\n"
        start_response({200: "200 OK", 404: "404 Not Found", 503: "503 Service Unavailable"}[status],
                       [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    def start(self, address: str, port: int) -> int:
        self._server = make_server(address, port, self.app, ThreadingWSGIServer, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="exporter", daemon=True).start()
        bound = self._server.server_address[1]
        log.info("serving /metrics", extra={"address": address, "port": bound})
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # scrapes every few seconds would drown the structured log
