"""exposition.render writes what prometheus_client's writers write, byte for byte, on
generated families of every type (hostile label values, every kind of float), and on the
exporter's own output; where it cannot, it says so (None) and the scrape falls back."""

from __future__ import annotations

import gzip
import io

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily, StateSetMetricFamily,
                                    SummaryMetricFamily)
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics

from rankmeter import exposition

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True).filter(lambda n: not n.startswith("__"))
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**18, 10**18),
                   st.sampled_from([0.0, -0.0, 1e21, 1234567.0, 0.1, 5e-324]))
LABEL_VALUES = st.text(max_size=12) | st.sampled_from(['a"b', "c\\d", "e\nf", "\\n", '"'])
DOC = st.text(max_size=20)


@st.composite
def family(draw):
    name = draw(NAMES)
    labels = draw(st.lists(NAMES, max_size=3, unique=True).filter(lambda ls: "le" not in ls and "quantile" not in ls))
    kind = draw(st.sampled_from(["gauge", "counter", "histogram", "gaugehistogram", "summary", "info", "stateset"]))
    doc = draw(DOC)
    rows = draw(st.lists(st.tuples(*(LABEL_VALUES for _ in labels)), max_size=4, unique=True))
    if kind == "gauge":
        f = GaugeMetricFamily(name, doc, labels=labels)
        for row in rows:
            f.add_metric(list(row), draw(VALUES))
    elif kind == "counter":
        f = CounterMetricFamily(name, doc, labels=labels)
        for row in rows:
            f.add_metric(list(row), draw(VALUES), created=draw(st.none() | st.floats(0, 2e9)))
    elif kind in ("histogram", "gaugehistogram"):
        cls = HistogramMetricFamily if kind == "histogram" else GaugeHistogramMetricFamily
        f = cls(name, doc, labels=labels)
        for row in rows:
            buckets = [(str(b), c) for b, c in [("0.5", 1.0), ("+Inf", draw(VALUES))]]
            if kind == "histogram":
                f.add_metric(list(row), buckets, sum_value=draw(VALUES))
            else:
                f.add_metric(list(row), buckets, gsum_value=draw(VALUES))
    elif kind == "summary":
        f = SummaryMetricFamily(name, doc, labels=labels)
        for row in rows:
            f.add_metric(list(row), count_value=draw(VALUES), sum_value=draw(VALUES))
    elif kind == "info":
        f = InfoMetricFamily(name, doc, labels=labels)
        for row in rows:
            f.add_metric(list(row), {"version": draw(LABEL_VALUES)})
    else:
        f = StateSetMetricFamily(name, doc, labels=[n for n in labels if n != name])
        for row in rows:
            f.add_metric(list(row)[:len(f._labelnames)], {"on": draw(st.booleans()), "off": False})
    return f


class Families:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def registry_of(families) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(Families(families))
    return registry


@settings(max_examples=300, deadline=None)
@given(st.lists(family(), max_size=4, unique_by=lambda f: f.name))
def test_the_same_bytes_as_prometheus_clients_writers(families) -> None:
    registry = registry_of(families)
    text = exposition.render(registry.collect(), openmetrics=False)
    assert text is not None  # (every family here is one it covers: the comparison is made)
    assert text == generate_latest(registry)
    om = exposition.render(registry.collect(), openmetrics=True)
    assert om is not None
    assert om == openmetrics.generate_latest(registry)


def test_what_it_does_not_cover_is_left_to_prometheus_client() -> None:
    with_unit = GaugeMetricFamily("size", "b", unit="bytes")
    with_unit.add_metric([], 3)
    assert exposition.render([with_unit], openmetrics=True) is None  # (its writer adds # UNIT)
    assert exposition.render([with_unit], openmetrics=False) == generate_latest(registry_of([with_unit]))
    odd_label = GaugeMetricFamily("g", "d", labels=["__reserved"])
    odd_label.add_metric(["x"], 1)
    colon = GaugeMetricFamily("job:rate", "d")
    colon.add_metric([], 1)
    utf8 = GaugeMetricFamily("größe", "d")
    utf8.add_metric([], 1)
    stamped = GaugeMetricFamily("t", "d")
    stamped.add_metric([], 1, timestamp=5)
    assert exposition.render([odd_label], openmetrics=False) is None
    assert exposition.render([colon], openmetrics=True) is None  # (its writer changes the colon)
    assert exposition.render([colon], openmetrics=False) == generate_latest(registry_of([colon]))
    assert exposition.render([utf8], openmetrics=False) is None
    assert exposition.render([stamped], openmetrics=False) is None


def test_format_of_follows_choose_encoder() -> None:
    cases = {
        "": False,
        "text/plain;version=0.0.4": False,
        "text/plain;version=1.0.0;escaping=allow-utf-8": False,
        "application/openmetrics-text;version=1.0.0": True,
        "application/openmetrics-text; version=1.0.0; escaping=underscores": True,
        "application/openmetrics-text;version=1.0.0;escaping=dots": None,
        "application/openmetrics-text;version=2.0.0": None,  # (native histograms: its writer)
        "application/openmetrics-text;version=0.0.1": False,  # (prometheus_client answers the text format)
        # What Prometheus sends by default: the first choice wins in choose_encoder.
        "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
        "text/plain;version=0.0.4;q=0.3,*/*;q=0.2": True,
    }
    for accept, expected in cases.items():
        assert exposition.format_of(choose_encoder(accept)[0]) is expected, accept


def pipeline_with_series():
    """A pipeline holding a few rankers' queries, some clicked (every family the exporter writes)."""
    import json
    import time

    from rankmeter import config
    from rankmeter.pipeline import Pipeline
    from rankmeter.source import Bus
    from rankmeter.store import MemoryStore

    settings = config.load(None, {})
    bus, now = Bus(partitions=2), int(time.time() * 1000)
    for q in range(60):
        results = [f"d{(q * 7 + i) % 50}" for i in range(10)]
        bus.send(settings.kafka.impressions_topic, f"q{q}".encode(), json.dumps(
            {"query_id": f"q{q}", "ranker": f"ranker-{q % 3}", "timestamp": now, "results": results}).encode())
        if q % 2:
            bus.send(settings.kafka.feedback_topic, f"q{q}".encode(), json.dumps(
                {"query_id": f"q{q}", "doc_id": results[q % 10], "timestamp": now, "action": "click",
                 "event_id": f"{q}-c"}).encode())
    pipeline = Pipeline(settings, MemoryStore(), lambda record, reason: None)
    bus.subscribe([settings.kafka.impressions_topic, settings.kafka.feedback_topic], pipeline.assign, pipeline.revoke)
    for batch in iter(lambda: bus.poll(0, 5000), []):
        pipeline.process(batch)
    return pipeline


def test_the_exporters_scrape_matches_prometheus_clients_app(tmp_path) -> None:
    """The exporter's /metrics, for each Accept header, answers the body and headers that
    prometheus_client's own app answers for the same registry."""
    from prometheus_client import make_wsgi_app

    from rankmeter.exporter import Exporter, Health

    exporter = Exporter(pipeline_with_series().readout, Health(), dict)
    exporter.batch_duration.observe(0.2)
    Counter("extra_things", "c", registry=exporter.registry).inc(3)
    Histogram("extra_seconds", "h", ["job"], registry=exporter.registry).labels('a"\\\n').observe(1)
    theirs = make_wsgi_app(exporter.registry)

    def call(app, accept: str, encoding: str = "", query: str = "") -> tuple[str, list, bytes]:
        got = {}
        body = b"".join(app({"PATH_INFO": "/metrics", "REQUEST_METHOD": "GET", "HTTP_ACCEPT": accept,
                             "HTTP_ACCEPT_ENCODING": encoding, "QUERY_STRING": query, "wsgi.input": io.BytesIO()},
                            lambda status, headers: got.update(status=status, headers=headers)))
        if encoding:
            body = gzip.decompress(body)
        return got["status"], got["headers"], body

    for accept in ("", "text/plain;version=0.0.4", "application/openmetrics-text;version=1.0.0",
                   "application/openmetrics-text;version=1.0.0;escaping=dots"):
        for encoding in ("", "gzip"):
            mine, reference = call(exporter.app, accept, encoding), call(theirs, accept, encoding)
            assert mine == reference, (accept, encoding)
            assert b"rankmeter_quality{" in mine[2]
    assert call(exporter.app, "", query="name[]=extra_things") == call(theirs, "", query="name[]=extra_things")
