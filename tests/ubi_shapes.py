"""UBI records written the way OpenSearch's own tools write them, and the native events
they stand for: shared by the unit and the integration tests of UBI input (issue 12).

`make_query_event` and `make_ubi_event` are the UBI data generator's functions
(opensearch-project/user-behavior-insights, ubi-data-generator/ubi_data_generator.py,
Apache-2.0), copied as they are but for `row` being a dict instead of a pandas row and
`gen_config` reduced to its `application`. The generator's positions are 0-based
(`np.arange`) and its query records carry no hit ids.
"""

from __future__ import annotations

import random
import uuid
from datetime import datetime, timezone
from types import SimpleNamespace


def make_query_event(gen_config, row):
    response_id = str(uuid.uuid4())  # noqa: F841 (as in the generator: unused there too)
    query_event = {
        "application": gen_config.application,
        "query_id": row["query_id"],
        "client_id": row["client_id"],
        "user_query": row["user_query"],
        "query_attributes": {},
        "timestamp": row["timestamp"],
    }
    return query_event


def make_ubi_event(gen_config, row):
    ubi_event = {
        "application": gen_config.application,
        "action_name": row["action_name"],
        "query_id": row["query_id"],
        "session_id": row["session_id"],
        "client_id": row["client_id"],
        "timestamp": row["timestamp"],
        "user_query": row["user_query"],
        "message_type": None,
        "message": None,
        "event_attributes": {
            "object": {
                "object_id": row["object_id"],
                "object_id_field": row["object_id_field"],
                "search_config": row["search_config"],
            },
            "position": {
                "ordinal": row["position"],
            },
        }
    }
    return ubi_event


def iso(ms: int) -> str:
    """The generator's timestamp format: `%Y-%m-%dT%H:%M:%S.%f`[:-3] + "Z"."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Query:
    """One search as it happened: who ran it, what was shown, what was clicked (and when)."""

    def __init__(self, query_id: str, ranker: str, timestamp_ms: int, shown: list[str],
                 clicks: list[tuple[str, int]]) -> None:
        self.query_id, self.ranker, self.timestamp_ms = query_id, ranker, timestamp_ms
        self.shown, self.clicks = shown, clicks


def searches(seed: int, count: int, now_ms: int, rankers: tuple[str, ...] = ("esci_ubi_sample", "ltr-v2"),
             ) -> list[Query]:
    """Random searches over a small catalogue: lists of 3–10 products, clicks skewed to the
    top (some on the same product twice), some searches without clicks."""
    rnd = random.Random(seed)
    out = []
    for i in range(count):
        shown = rnd.sample([f"B0{n:05d}" for n in range(200)], rnd.randint(3, 10))
        delays = rnd.sample(range(1000, 60_000), rnd.choice([0, 0, 1, 1, 2, 3]))  # distinct: distinct events
        clicks = [(shown[min(int(rnd.expovariate(0.5)), len(shown) - 1)], delay) for delay in delays]
        out.append(Query(f"{seed}-{i}-{uuid.UUID(int=rnd.getrandbits(128))}", rnd.choice(rankers),
                         now_ms - rnd.randrange(3_600_000), shown, clicks))
    return out


def native(queries: list[Query]) -> list[tuple[str, str, dict]]:
    """(stream, key, record): what rankmeter's own schema says about the same searches."""
    out = []
    for q in queries:
        out.append(("impressions", q.query_id, {"query_id": q.query_id, "ranker": q.ranker,
                                                "timestamp": q.timestamp_ms, "results": q.shown}))
        for n, (doc, delay) in enumerate(q.clicks):
            out.append(("feedback", q.query_id, {"event_id": f"{q.query_id}:c{n}", "query_id": q.query_id,
                                                 "action": "click", "doc_id": doc,
                                                 "timestamp": q.timestamp_ms + delay}))
    return out


def generator(queries: list[Query]) -> list[tuple[str, str, dict]]:
    """The UBI data generator's shape: a query record without hit ids (the ranker is the
    `application`), one `impression` event per shown product with its 0-based position in
    `position.ordinal`, and click events carrying the same fields."""
    out = []
    for q in queries:
        config = SimpleNamespace(application=q.ranker)
        row = {"query_id": q.query_id, "client_id": "c1", "user_query": "usb cable", "session_id": "s1",
               "timestamp": iso(q.timestamp_ms), "object_id_field": "product_id", "search_config": "teamA"}
        out.append(("impressions", q.query_id, make_query_event(config, row)))
        for position, doc in enumerate(q.shown):
            out.append(("feedback", q.query_id, make_ubi_event(config, {
                **row, "action_name": "impression", "object_id": doc, "position": position})))
        for doc, delay in q.clicks:
            out.append(("feedback", q.query_id, make_ubi_event(config, {
                **row, "action_name": "click", "object_id": doc, "position": q.shown.index(doc),
                "timestamp": iso(q.timestamp_ms + delay)})))
    return out


def collector(queries: list[Query]) -> list[tuple[str, str, dict]]:
    """What the UBI JavaScript collector (ubi-javascript-collector/ubi.js) sends: its
    `UbiQueryRequest` (no hit ids at all; the ranker in `query_attributes`, `object_id_field`)
    and `UbiEvent`s built with `UbiEventAttributes` (an object with a description, and a
    position that is an `ordinal` or an `xy`), serialised without nulls. Here the page shows
    a grid of 4 columns: impression events say where (`xy`), clicks their ordinal."""
    out = []
    for q in queries:
        out.append(("impressions", q.query_id, {
            "application": "shop", "query_id": q.query_id, "client_id": "c1", "user_query": "usb cable",
            "query_attributes": {"ranker": q.ranker}, "object_id_field": "sku", "timestamp": iso(q.timestamp_ms)}))

        def event(action: str, doc: str, ms: int, position: dict) -> dict:
            return {"application": "shop", "action_name": action, "query_id": q.query_id, "session_id": "s1",
                    "client_id": "c1", "user_id": "", "timestamp": iso(ms), "message_type": "INFO", "message": "",
                    "event_attributes": {"object": {"object_id": doc, "object_id_field": "sku",
                                                    "description": f"product {doc}"},
                                         "position": position}}

        for n, doc in enumerate(q.shown):
            out.append(("feedback", q.query_id, event("impression", doc, q.timestamp_ms + 300,
                                                      {"xy": {"x": 20.0 + 240 * (n % 4), "y": 180.5 + 320 * (n // 4)}})))
        for doc, delay in q.clicks:
            out.append(("feedback", q.query_id, event("click", doc, q.timestamp_ms + delay,
                                                      {"ordinal": q.shown.index(doc) + 1})))
    return out


def empty_hits(queries: list[Query]) -> list[tuple[str, str, dict]]:
    """Query records with an empty `query_response_hit_ids` and the ranker in
    `query_attributes`, impression events with a 0-based `position.index`, clicks with a
    1-based `position.ordinal` (the issue's description of collectors in the wild)."""
    out = []
    for q in queries:
        out.append(("impressions", q.query_id, {
            "application": "shop", "query_id": q.query_id, "client_id": "c1", "user_query": "usb cable",
            "query_attributes": {"ranker": q.ranker}, "object_id_field": "sku",
            "query_response_hit_ids": [], "timestamp": iso(q.timestamp_ms)}))
        for index, doc in enumerate(q.shown):
            out.append(("feedback", q.query_id, {
                "application": "shop", "action_name": "impression", "query_id": q.query_id,
                "client_id": "c1", "session_id": "s1", "timestamp": iso(q.timestamp_ms + 200),
                "message_id": f"{q.query_id}:i{index}",
                "event_attributes": {"object": {"object_id": doc, "object_id_field": "sku"},
                                     "position": {"index": index}}}))
        for n, (doc, delay) in enumerate(q.clicks):
            out.append(("feedback", q.query_id, {
                "application": "shop", "action_name": "click", "query_id": q.query_id,
                "client_id": "c1", "session_id": "s1", "timestamp": iso(q.timestamp_ms + delay),
                "message_id": f"{q.query_id}:c{n}",
                "event_attributes": {"object": {"object_id": doc, "object_id_field": "sku"},
                                     "position": {"ordinal": q.shown.index(doc) + 1}}}))
    return out


def ranked(queries: list[Query]) -> list[tuple[str, str, dict]]:
    """Impression events with a 0-based `event_attributes.rank` (the issue's third shape)."""
    out = []
    for stream, key, record in generator(queries):
        if stream == "feedback":
            attributes = record["event_attributes"]
            attributes["rank"] = attributes.pop("position")["ordinal"]
        out.append((stream, key, record))
    return out


SHAPES = {"generator": generator, "collector": collector, "empty-hits": empty_hits, "rank": ranked}


def event_ms(record: dict) -> int:
    t = record["timestamp"]
    return t if isinstance(t, int) else int(datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() * 1000)


def in_time_order(stream: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """As a live site sends them: by event time (a click comes when it happens, after the
    next searches' records)."""
    return sorted(stream, key=lambda item: event_ms(item[2]))
