"""The Quix Streams peer of `rankmeter serve` for bench/bench_serve.py (issue 10): a Quix
Streams 3.x application doing only the per-query join of impressions and feedback and
nDCG@10, in its RocksDB state, nothing more (no windows, no other measures, no dead
letters, no exporter). It reads the two co-partitioned topics as one StreamingDataFrame
(`concat`: one state store for both), keyed by query_id as rankmeter's topics are, and
prints its rate from the first record to the last.

Not a dependency of rankmeter; for the bench only:

    .venv/bin/pip install quixstreams   # 3.x; it pins confluent-kafka < 2.13
    .venv/bin/python bench/quix_peer.py --bootstrap 127.0.0.1:19092 \\
        --impressions t.impressions --feedback t.feedback --total 500000
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import uuid

from quixstreams import Application, State

# rankmeter's default grade map (evaluation.grades, long_dwell_ms/grade).
GRADES = {"click": 1.0, "add_to_cart": 2.0, "purchase": 3.0}
LONG_DWELL_MS, LONG_DWELL_GRADE = 30_000, 2.0
DISCOUNT = [1 / math.log2(i + 2) for i in range(10)]


def ndcg10(results: list[str], judged: dict[str, float], implicit: dict[str, float]) -> float:
    """trec_eval's ndcg_cut.10: a judgment wins over implicit grades, which keep their maximum;
    the ideal ranking is over every known grade (documents not shown included)."""
    grades = {**implicit, **judged}
    dcg = sum(grades.get(d, 0.0) * DISCOUNT[i] for i, d in enumerate(results[:10]))
    ideal = sorted(grades.values(), reverse=True)[:10]
    idcg = sum(g * DISCOUNT[i] for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def join(event: dict, state: State) -> None:
    """One event of either topic, in the state of its query (the message key)."""
    if "results" in event:  # an impression: the first one wins
        if state.get("results") is None:
            state.set("results", list(dict.fromkeys(event["results"])))
    else:
        doc, action = event["doc_id"], event["action"]
        if action == "judgment":
            judged = state.get("judged", {})
            judged[doc] = float(event["grade"])
            state.set("judged", judged)
        elif action in GRADES:
            grade = GRADES[action]
            if action == "click" and event.get("dwell_ms", 0) >= LONG_DWELL_MS:
                grade = LONG_DWELL_GRADE
            implicit = state.get("implicit", {})
            if grade > implicit.get(doc, 0.0):
                implicit[doc] = grade
                state.set("implicit", implicit)
    results = state.get("results")
    if results is not None:
        state.set("ndcg10", ndcg10(results, state.get("judged", {}), state.get("implicit", {})))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--impressions", required=True)
    ap.add_argument("--feedback", required=True)
    ap.add_argument("--total", type=int, required=True, help="stop after this many records")
    ap.add_argument("--state-dir", default=f"/tmp/quix-peer-{uuid.uuid4().hex[:6]}")
    args = ap.parse_args()

    # Defaults otherwise (at-least-once, RocksDB state with its changelog topics, commits
    # every 5 s), as a Quix application would run.
    app = Application(broker_address=args.bootstrap, consumer_group=f"quix-{uuid.uuid4().hex[:6]}",
                      auto_offset_reset="earliest", state_dir=args.state_dir, loglevel=logging.WARNING)
    impressions = app.dataframe(app.topic(args.impressions, value_deserializer="json"))
    feedback = app.dataframe(app.topic(args.feedback, value_deserializer="json"))
    seen, started = [0], [0.0]

    def count(_: dict) -> None:
        if seen[0] == 0:
            started[0] = time.perf_counter()
        seen[0] += 1
        if seen[0] == args.total:
            started.append(time.perf_counter())
            app.stop()

    impressions.concat(feedback).update(join, stateful=True).update(count)
    app.run()
    if len(started) < 2:
        print(f"stopped after {seen[0]} of {args.total} records", file=sys.stderr)
        return 1
    print(f"records={seen[0]}")
    print(f"events_per_second={args.total / (started[1] - started[0]):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
