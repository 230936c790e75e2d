"""Alert quality on simulated weeks of traffic, measured with the real Prometheus.

    set -a; eval "$(scripts/services.sh env)"; set +a
    .venv/bin/python bench/alert_quality.py --seed 11 --seed 12 --seed 13 --days 7

1. **History.** `--days` of event-time traffic with daily and weekly cycles
   (`simulator/history.py`): `bm25-tuned` at 1,000 queries an hour at its daily peak and
   `bm25-canary` (the same ranker) at 20, both production rankers. From day 2 on, one
   regression a day on `bm25-tuned`, 2 hours at a random hour (seeded), alternately
   nDCG@10 −10 % (a ranking regression whose size is calibrated on the embedded pipeline
   so that the measured nDCG@10 drops by 10 %) and CTR −5 % (a presentation regression:
   every result 5 % less attractive).
2. **Replay.** Through Kafka and `rankmeter serve --event-clock` (Redis state), one
   minute of event time at a time: produce the minute (Kafka timestamps = event time),
   wait until the consumer group has committed the end of the topics (the batch is
   stored and counted by then), scrape /metrics and stamp the scrape with the minute.
3. **Prometheus.** The scrapes become a TSDB (`promtool tsdb create-blocks-from
   openmetrics`); the shipped recording rules of deploy/prometheus/rules.yml are
   backfilled over them (`promtool tsdb create-blocks-from rules`, one pass per level of
   dependency, as that backfill requires); the real Prometheus serves the result.
4. **Alerts.** Every alert of the rule file is evaluated over the whole history with
   Prometheus' own engine (query_range at the rule interval) and `for:` applied as the
   rule manager applies it (pending from the first evaluation with a result, firing once
   it has held for `for`).
5. **Report.** Per alert and ranker: pages outside the regressions (a page that starts
   more than the largest alert window + its `for:` after a regression ended, or before it
   began, is false), warnings likewise, and each regression's detection delay (the first
   page about that ranker starting within the regression or the hour after it). The
   noise floor: the smallest relative change each rule can flag at the daily peak and
   trough, from the measured standard errors and the rule file's constants. The last
   lines are `false_pages_per_week=…`, `missed_regressions=…`, `median_detection_minutes=…`.

Needs Kafka and Redis (RANKMETER_KAFKA_BOOTSTRAP_SERVERS, RANKMETER_REDIS_URL) and the
`prometheus` and `promtool` binaries. About 10 minutes for 7 days on two cores.
`tests/integration/test_alert_quality.py` runs a short seeded version in `make test`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from progress import Progress  # noqa: E402  (bench/, beside this script)

from rankmeter import config  # noqa: E402
from rankmeter.pipeline import Pipeline  # noqa: E402
from rankmeter.simulator.history import DAY_MS, HOUR_MS, MINUTE_MS, History  # noqa: E402
from rankmeter.simulator.regressions import Regression  # noqa: E402
from rankmeter.source import Bus  # noqa: E402
from rankmeter.store import MemoryStore  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
BIG, CANARY = "bm25-tuned", "bm25-canary"
QUALITY_ALERTS = ("RankmeterQualityDrop", "RankmeterQualityDropFast", "RankmeterCTRDrop", "RankmeterAbandonmentSpike")
KEPT_METRICS = {"nDCG@10", "CTR", "Abandonment"}
KEPT_FAMILIES = {"rankmeter_quality_numerator", "rankmeter_quality_denominator", "rankmeter_quality_squares",
                 "rankmeter_queries", "rankmeter_events", "rankmeter_ranker_info", "rankmeter_consumer_lag_seconds",
                 "rankmeter_consumer_lag"}
STEP_S = 60
# Histories end here unless told otherwise (a Monday, 00:00 UTC): Kafka (retention.ms=-1)
# and Prometheus (3650 days' retention) keep old timestamps; serve runs on the event clock.
END_MS = int(datetime(2026, 11, 30, tzinfo=timezone.utc).timestamp() * 1000)


class Injected(NamedTuple):
    """A regression as the report names it, with the simulator's regression behind it."""
    label: str  # "nDCG@10 -10%" or "CTR -5%"
    start_ms: int
    end_ms: int
    regression: Regression


class Firing(NamedTuple):
    alert: str
    labels: dict[str, str]
    start_ms: int  # first evaluation at which it fired
    end_ms: int    # last evaluation at which it still fired

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")


# ---- 1. history ----

CLICK_MODEL = "dcm"  # the dependent click model: clicks depend on the ones above (Guo et al. 2009)


def measured(kind: str, size: float, seed: int) -> tuple[float, float, float]:
    """(nDCG@10 macro over judged queries, judged share, CTR macro) of 6 hours of the big
    ranker's traffic at 5,000 queries/h with this regression throughout, as the service
    measures them (the embedded pipeline, the complete 24h window)."""
    start = 1_800_000_000_000 - 1_800_000_000_000 % DAY_MS + 14 * HOUR_MS
    regressions = [Regression(0, 10 * 3600, BIG, kind, size)] if size else []
    history = History(start, start + 6 * HOUR_MS, {BIG: 5000}, regressions=regressions, seed=seed,
                      click_model=CLICK_MODEL, disorder=0.0)
    settings = config.load(None, {"RANKMETER_EVALUATION_MEASURES": "nDCG@10"})
    bus = Bus(partitions=1)
    topics = {"impressions": settings.kafka.impressions_topic, "feedback": settings.kafka.feedback_topic}
    for event in history:
        bus.send(topics[event.stream], event.key.encode(), json.dumps(event.value).encode(),
                 timestamp_ms=event.timestamp_ms)
    pipeline = Pipeline(settings, MemoryStore(), lambda r, why: None, clock=lambda: (start + 8 * HOUR_MS) / 1000)
    bus.subscribe(list(topics.values()), pipeline.assign, pipeline.revoke)
    while records := bus.poll(0, 20_000):
        pipeline.process(records)
    view = next(v for v in pipeline.views() if v.window == "24h" and v.ranker == BIG)
    return view.sums["nDCG@10"].macro(), view.queries_judged / view.queries_all, view.sums["CTR"].macro()


def calibrate(seed: int) -> tuple[float, float, list[str]]:
    """The sizes of the two regressions, so that the service *measures* nDCG@10 10 % lower
    (a share of lists degraded) and CTR 5 % lower (results less attractive), under the
    bench's click model; with the lines saying so."""
    (m0, j0, c0), (m1, j1, _) = measured("ranking", 0.0, seed), measured("ranking", 1.0, seed)
    target = 0.9 * m0
    if m1 >= target:
        raise SystemExit(f"a fully degraded ranker measures nDCG@10 {m1:.3f}: it cannot drop 10% below {m0:.3f}")
    # A share p of degraded lists: the measured mean weighs each kind by its judged share.
    ranking = j0 * (m0 - target) / (j0 * (m0 - target) + j1 * (target - m1))
    # Under a dependent click model CTR is not proportional to attractiveness: interpolate.
    a, b = 0.05, 0.15
    ca, cb = measured("clicks", a, seed)[2], measured("clicks", b, seed)[2]
    clicks = a + (0.95 * c0 - ca) * (b - a) / (cb - ca)
    check_n, check_c = measured("ranking", ranking, seed)[0], measured("clicks", clicks, seed)[2]
    return ranking, clicks, [
        f"  calibration ({CLICK_MODEL} clicks, 30,000 queries a point): nDCG@10 {m0:.4f} healthy, {m1:.4f} fully "
        f"degraded -> {ranking:.3f} of lists degraded (check: {check_n / m0 - 1:+.1%}); CTR {c0:.4f} -> results "
        f"{clicks:.3f} less attractive (check: {check_c / c0 - 1:+.1%})"]


def schedule(days: int, start_ms: int, seed: int, ranking_size: float, clicks_size: float) -> list[Injected]:
    """One 2-hour regression a day from day 2 on (days 0 and 1 stay clean), at a seeded
    random hour, alternately nDCG@10 −10 % and CTR −5 %."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for i, day in enumerate(range(2, days)):
        begin = start_ms + day * DAY_MS + int(rng.integers(0, 22 * 60)) * MINUTE_MS
        kind, size, label = (("ranking", ranking_size, "nDCG@10 -10%") if i % 2 == 0
                             else ("clicks", clicks_size, "CTR -5%"))
        regression = Regression((begin - start_ms) / 1000, 2 * 3600, BIG, kind, size)
        out.append(Injected(label, begin, begin + 2 * HOUR_MS, regression))
    return out


# ---- 2. replay through Kafka and rankmeter serve ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replay:
    """`rankmeter serve --event-clock` on private topics, group and Redis prefix."""

    def __init__(self, bootstrap: str, redis_url: str, workdir: Path, run_id: str) -> None:
        from kafka import KafkaAdminClient, KafkaProducer
        from kafka.admin import NewTopic

        self.bootstrap, self.redis_url, self.run_id = bootstrap, redis_url, run_id
        self.topics = {"impressions": f"aq-{run_id}.impressions", "feedback": f"aq-{run_id}.feedback"}
        self.group, self.prefix, self.port = f"aq-{run_id}", f"aq-{run_id}", free_port()
        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), client_id="alert-quality")
        # Kept forever: the history's timestamps are up to a week old (time-based retention would apply).
        self.admin.create_topics([NewTopic(t, num_partitions=2, replication_factor=1,
                                           topic_configs={"retention.ms": "-1"})
                                  for t in [*self.topics.values(), f"aq-{run_id}.dlq"]])
        self.producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), linger_ms=0, acks=1)
        self.ends: dict[tuple[str, int], int] = {}
        env = {**os.environ,
               "RANKMETER_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "RANKMETER_KAFKA_GROUP_ID": self.group,
               "RANKMETER_KAFKA_IMPRESSIONS_TOPIC": self.topics["impressions"],
               "RANKMETER_KAFKA_FEEDBACK_TOPIC": self.topics["feedback"],
               "RANKMETER_KAFKA_DEAD_LETTER_TOPIC": f"aq-{run_id}.dlq",
               "RANKMETER_REDIS_URL": redis_url, "RANKMETER_REDIS_KEY_PREFIX": self.prefix,
               "RANKMETER_METRICS_PORT": str(self.port), "RANKMETER_METRICS_BIND_ADDRESS": "127.0.0.1",
               "RANKMETER_EVALUATION_MEASURES": "nDCG@10",
               "RANKMETER_ALERTS_PRODUCTION_RANKERS": f"{BIG},{CANARY}"}
        self.log = open(workdir / "serve.log", "w")
        self.process = subprocess.Popen([sys.executable, "-m", "rankmeter", "serve", "--event-clock"],
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""
        except OSError:
            return 0, ""

    def _wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while self._get("/readyz")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"rankmeter serve did not become ready; see {self.log.name}")
            time.sleep(0.2)

    def send(self, events: Sequence) -> None:
        futures = [self.producer.send(self.topics[e.stream], key=e.key.encode(), value=json.dumps(e.value).encode(),
                                      timestamp_ms=e.timestamp_ms) for e in events]
        self.producer.flush()
        for f in futures:
            meta = f.get(timeout=30)
            key = (meta.topic, meta.partition)
            self.ends[key] = max(self.ends.get(key, 0), meta.offset + 1)

    def wait_consumed(self, timeout_s: float = 120) -> None:
        """Until the group has committed the end of every partition written to: serve
        commits a batch's offsets to Kafka only once its checkpoint is stored and counted."""
        deadline = time.monotonic() + timeout_s
        while True:
            committed = {(tp.topic, tp.partition): meta.offset
                         for tp, meta in self.admin.list_group_offsets(self.group)[self.group].items()}
            if all(committed.get(tp, 0) >= end for tp, end in self.ends.items()):
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"rankmeter serve stopped consuming; see {self.log.name}")
            time.sleep(0.003)

    def scrape(self) -> str:
        status, text = self._get("/metrics")
        if status != 200:
            raise SystemExit(f"/metrics answered {status}; see {self.log.name}")
        return text

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.producer.close()
        try:
            self.admin.delete_topics([*self.topics.values(), f"aq-{self.run_id}.dlq"])
        except Exception:  # noqa: BLE001 (best effort: the topics are private to this run)
            pass
        self.admin.close()
        import redis

        client = redis.Redis.from_url(self.redis_url)
        for key in client.scan_iter(match=f"*{self.prefix}*", count=1000):
            client.delete(key)
        self.log.close()


_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


class Samples:
    """Scraped series, kept for the TSDB: (family, type) -> series -> [(t_ms, value)]."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.series: dict[tuple[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], list]] = {}

    def add(self, text: str, t_ms: int) -> None:
        # A line parser of our own exposition's counters and gauges (prometheus_client's
        # parser took 60 ms a scrape, two thirds of the replay, over 2,000 scrapes a run).
        family: tuple[str, str] | None = None
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                kept = name.removesuffix("_total") in KEPT_FAMILIES
                family = (name.removesuffix("_total") if kind == "counter" else name, kind) if kept else None
                continue
            if family is None or line.startswith("#") or not line:
                continue
            sample = _SAMPLE.fullmatch(line)
            if sample is None:
                raise ValueError(f"cannot read the exposition line {line[:200]!r}")
            name, label_text, value = sample.groups()
            labels = {k: _unescape(v) for k, v in _LABEL.findall(label_text or "")}
            if name.endswith("_created") or labels.get("metric", "nDCG@10") not in KEPT_METRICS:
                continue
            key = (name, tuple(sorted({**labels, "job": "rankmeter", "instance": self.instance}.items())))
            self.series.setdefault(family, {}).setdefault(key, []).append((t_ms, float(value)))
        # The scrape succeeded: Prometheus would record up = 1.
        self.series.setdefault(("up", "gauge"), {}).setdefault(
            ("up", (("instance", self.instance), ("job", "rankmeter"))), []).append((t_ms, 1.0))

    def write_openmetrics(self, path: Path) -> None:
        write_openmetrics(self.series, path)

    def values(self, name: str, **labels: str) -> dict[int, float]:
        """t_ms -> sum over the series of `name` whose labels include these."""
        out: dict[int, float] = {}
        for per in self.series.values():
            for (n, ls), points in per.items():
                if n == name and all(dict(ls).get(k) == v for k, v in labels.items()):
                    for t, v in points:
                        out[t] = out.get(t, 0.0) + v
        return out


Series = dict[tuple[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[int, float]]]]


def write_openmetrics(series: Series, path: Path) -> None:
    """(family, type) -> (sample name, labels) -> [(t_ms, value)] as OpenMetrics with
    timestamps, each family once (as `promtool tsdb create-blocks-from openmetrics` wants)."""
    def quoted(value: str) -> str:
        return value.replace("\\", r"\\").replace('"', r'\"').replace("\n", r"\n")

    def number(v: float) -> str:
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf") if math.isinf(v) else repr(v)

    with open(path, "w") as out:
        for (family, kind), per in series.items():
            out.write(f"# TYPE {family} {kind}\n")
            for (name, labels), points in per.items():
                head = name + "{" + ",".join(f'{k}="{quoted(v)}"' for k, v in labels) + "}"
                out.writelines(f"{head} {number(v)} {t / 1000:.3f}\n" for t, v in points)
        out.write("# EOF\n")


def replay(history: History, start_ms: int, end_ms: int, samples: Samples, replay_: Replay) -> None:
    steps = (end_ms - start_ms) // (STEP_S * 1000)
    progress = Progress("replayed", steps, "minutes of event time")
    spent = dict.fromkeys(("generate", "produce", "consume", "scrape"), 0.0)
    for i in range(1, steps + 1):
        t = start_ms + i * STEP_S * 1000
        t0 = time.perf_counter()
        events = list(history.until(t - 1))  # the minute (t − 1 min, t]: windows end at t's minute
        t1 = time.perf_counter()
        if events:
            replay_.send(events)
            t2 = time.perf_counter()
            replay_.wait_consumed()
        else:
            t2 = t1
        t3 = time.perf_counter()
        samples.add(replay_.scrape(), t)
        for name, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)):
            spent[name] += dt
        progress(i)
    print("  replay time: " + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()), file=sys.stderr, flush=True)


# ---- 3. Prometheus over the history ----

class Prometheus:
    def __init__(self, data: Path, workdir: Path) -> None:
        self.data, self.workdir = data, workdir
        self.port = 0
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.port = free_port()
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text("global:\n  evaluation_interval: 1m\n")
        self.log = open(self.workdir / "prometheus.log", "a")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config_file}", f"--storage.tsdb.path={self.data}",
             "--storage.tsdb.retention.time=3650d", f"--web.listen-address=127.0.0.1:{self.port}",
             # Backfilled series carry no staleness markers: a lookback of one scrape interval
             # lets a series that stopped vanish as it would live.
             f"--query.lookback-delta={STEP_S}s",
             "--query.max-samples=200000000"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"prometheus did not start; see {self.workdir / 'prometheus.log'}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=60)
            self.process = None
            self.log.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: int) -> list[dict]:
        """Matrix result, in chunks of at most a day (Prometheus caps points per series)."""
        out: dict[tuple, dict] = {}
        chunk = 86_400
        t = start_s
        while t <= end_s:
            stop = min(t + chunk - step_s, end_s)
            query = urllib.parse.urlencode({"query": expr, "start": t, "end": stop, "step": step_s})
            with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{query}", timeout=600) as r:
                body = json.load(r)
            if body["status"] != "success":
                raise SystemExit(f"query failed: {body}")
            for series in body["data"]["result"]:
                key = tuple(sorted(series["metric"].items()))
                out.setdefault(key, {"metric": series["metric"], "values": []})["values"].extend(series["values"])
            t = stop + step_s
        return list(out.values())


def rule_levels(groups: Sequence[Mapping]) -> list[list[Mapping]]:
    """Recording rules by level of dependency: level 0 reads only scraped series, level
    k reads rules of levels below k (the rules backfill cannot see rules of its own pass)."""
    rules = [r for g in groups for r in g["rules"] if "record" in r]
    names = {r["record"] for r in rules}
    level: dict[str, int] = {}

    def of(rule: Mapping) -> int:
        if rule["record"] not in level:
            used = {n for n in names if re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])", rule["expr"])}
            used.discard(rule["record"])
            level[rule["record"]] = 1 + max((of(by_name[n]) for n in used), default=-1)
        return level[rule["record"]]

    by_name = {r["record"]: r for r in rules}
    levels: list[list[Mapping]] = []
    for rule in rules:
        k = of(rule)
        levels.extend([] for _ in range(k + 1 - len(levels)))
        levels[k].append(rule)
    return levels


def backfill(samples: Samples, rules: Mapping, start_ms: int, end_ms: int, workdir: Path) -> Prometheus:
    """The scrapes become a TSDB; then each level of recording rules is evaluated by
    Prometheus (query_range) at the scrape instants and written back as blocks before the
    next level — what a rule group evaluated right after each scrape records: every rule of
    an evaluation reads the same instant's values of the rules before it."""
    data = workdir / "tsdb"
    scraped = workdir / "scraped.om"
    samples.write_openmetrics(scraped)
    run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(scraped), str(data)])
    prometheus = Prometheus(data, workdir)
    for k, level in enumerate(rule_levels(rules["groups"])):
        prometheus.start()
        recorded: Series = {}
        for rule in level:
            per = recorded.setdefault((rule["record"], "gauge"), {})
            for series in prometheus.query_range(rule["expr"], start_ms / 1000, end_ms / 1000, STEP_S):
                labels = {**{k: v for k, v in series["metric"].items() if k != "__name__"},
                          **{k: str(v) for k, v in rule.get("labels", {}).items()}}
                # The record's name replaces the operands' (`a or b` returns series of both
                # names): the same labels then are one series, as the rule manager stores it.
                points = per.setdefault((rule["record"], tuple(sorted(labels.items()))), [])
                points.extend((round(float(t) * 1000), float(v)) for t, v in series["values"])
        for per in recorded.values():
            for key, points in per.items():
                per[key] = sorted(dict(points).items())
        prometheus.stop()
        level_file = workdir / f"recorded-{k}.om"
        write_openmetrics(recorded, level_file)
        run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(level_file), str(data)])
        print(f"  recording rules, level {k}: {len(level)} evaluated", file=sys.stderr, flush=True)
    prometheus.start()
    return prometheus


def run(command: list[str]) -> None:
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} failed: {out.stderr.strip()[-2000:]}")


def duration_s(text: str) -> int:
    return config.duration_ms(str(text)) // 1000


# ---- 4. alerts ----

def evaluate_alerts(prometheus: Prometheus, rules: Mapping, start_ms: int, end_ms: int) -> list[Firing]:
    """Each alert over the history, as the rule manager would have fired it: an alert is
    pending from the first evaluation with a result and fires once it has held for `for`."""
    firings: list[Firing] = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            hold_ms = duration_s(rule.get("for", "0s")) * 1000
            for series in prometheus.query_range(rule["expr"], start_ms / 1000, end_ms / 1000, STEP_S):
                labels = {**{k: v for k, v in series["metric"].items() if k != "__name__"},
                          **{k: str(v) for k, v in rule.get("labels", {}).items()}}
                firings.extend(Firing(rule["alert"], labels, a, b)
                               for a, b in hold(sorted(round(float(t) * 1000) for t, _ in series["values"]),
                                                STEP_S * 1000, hold_ms))
    return firings


def hold(times: Sequence[int], interval_ms: int, hold_ms: int) -> Iterator[tuple[int, int]]:
    """Firing intervals from the evaluation times at which the expression had a result:
    a run of consecutive evaluations fires from its first time + `hold_ms` on."""
    run_start = previous = None
    for t in [*times, None]:
        if t is not None and previous is not None and t - previous <= interval_ms:
            previous = t
            continue
        if run_start is not None and previous - run_start >= hold_ms:
            yield run_start + hold_ms, previous
        run_start = previous = t


# ---- 5. report ----

def score(firings: Sequence[Firing], injected: Sequence[Injected], grace_ms: int
          ) -> tuple[list[Firing], list[Firing], dict[Injected, int | None]]:
    """(false pages, other alerts outside the regressions, detection delay per regression
    in ms or None). A firing is explained by a regression of its ranker if it starts
    within the regression or `grace_ms` after it."""
    def explained(f: Firing) -> bool:
        return any(f.labels.get("ranker") == r.regression.ranker and r.start_ms <= f.start_ms <= r.end_ms + grace_ms
                   for r in injected)

    false_pages = [f for f in firings if f.severity == "page" and not explained(f)]
    false_warnings = [f for f in firings if f.severity != "page" and not explained(f)]
    delays: dict[Injected, int | None] = {}
    for r in injected:
        starts = [f.start_ms for f in firings if f.alert in QUALITY_ALERTS and f.severity == "page"
                  and f.labels.get("ranker") == r.regression.ranker and r.start_ms <= f.start_ms <= r.end_ms + grace_ms]
        delays[r] = min(starts) - r.start_ms if starts else None
    return false_pages, false_warnings, delays


def constants(rules: Mapping) -> dict[str, float]:
    """The rule file's tunable constants: recording rules whose expression is vector(N)."""
    out = {}
    for g in rules["groups"]:
        for r in g["rules"]:
            m = re.fullmatch(r"\s*vector\(\s*([0-9.eE+-]+)\s*\)\s*", str(r.get("expr", "")))
            if "record" in r and m:
                out[r["record"]] = float(m[1])
    return out


def window_mean(samples: Samples, metric: str, window: str) -> dict[int, tuple[float, float, float]]:
    """t_ms -> (mean, standard error, queries) of the big ranker's macro `metric` over `window`."""
    s1 = samples.values("rankmeter_quality_numerator", metric=metric, ranker=BIG, window=window, average="macro")
    n = samples.values("rankmeter_quality_denominator", metric=metric, ranker=BIG, window=window, average="macro")
    s2 = samples.values("rankmeter_quality_squares", metric=metric, ranker=BIG, window=window)
    out = {}
    for t, count in n.items():
        if count > 0:
            mean = s1[t] / count
            out[t] = (mean, math.sqrt(max(s2[t] / count - mean ** 2, 0.0) / count), count)
    return out


def realised(samples: Samples, r: Injected, injected: Sequence[Injected]) -> str:
    """The change the service measured: the live 1h window over the regression's two
    hours against the same two windows on the days without a regression then."""
    metric = "nDCG@10" if r.regression.kind == "ranking" else "CTR"
    means = window_mean(samples, metric, "1h")
    ends = (r.start_ms + HOUR_MS, r.start_ms + 2 * HOUR_MS)
    now = [means[t][0] for t in ends if t in means]
    others = [means[t + k * DAY_MS][0] for t in ends for k in range(-10, 11)
              if k and t + k * DAY_MS in means
              and not any(o.start_ms < t + k * DAY_MS and t + k * DAY_MS - HOUR_MS < o.end_ms for o in injected)]
    if not now or not others:
        return ""
    return f" (measured {metric} {statistics.mean(now) / statistics.median(others) - 1:+.1%})"


def noise_floor(samples: Samples, rules: Mapping) -> list[str]:
    """The smallest relative change of each alerted metric the rules can page on for the
    big ranker, at the daily peak and trough of the last day, from the measured standard
    errors and the rule file's constants: a change of max(margin, z·σ) is caught about half
    the time, one of max(margin, (z + 1.645)·σ) 95 % of the time, σ being the standard
    error of the difference to a 7-day same-hour median (σ_window × sqrt(1 + 1.25²/7))."""
    c = constants(rules)
    z = next((v for k, v in c.items() if "z_score" in k), float("nan"))
    margin = next((v for k, v in c.items() if "margin" in k), float("nan"))
    min_samples = next((v for k, v in c.items() if "min_samples" in k), float("nan"))
    lines = []
    for metric, windows in (("nDCG@10", ("15m", "1h")), ("CTR", ("1h",)), ("Abandonment", ("1h",))):
        for window in windows:
            means = window_mean(samples, metric, window)
            last_day = [t for t in means if t >= max(means) - DAY_MS] if means else []
            if not last_day:
                continue
            by_count = sorted(last_day, key=lambda t: means[t][2])
            for name, t in (("peak", by_count[-1]), ("trough", by_count[0])):
                mean, se, count = means[t]
                if mean <= 0:
                    continue
                sigma = se * math.sqrt(1 + 1.25 ** 2 / 7) / mean
                guard = "" if count >= min_samples else f" (under the {min_samples:.0f}-query guard: silent)"
                lines.append(f"  {metric:<12} {window:>4} at the {name:<6}: {count:>5.0f} queries, mean {mean:.4f}, "
                             f"se {se:.4f} -> pages on a change of {max(margin, z * sigma):.1%} half the time, "
                             f"{max(margin, (z + 1.645) * sigma):.1%} 95% of the time{guard}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, action="append", help="repeatable: one history per seed, "
                        "figures over all of them (default 11)")
    parser.add_argument("--days", type=float, default=7.0, help="days of event time per seed (default 7)")
    parser.add_argument("--peak", type=float, default=1000.0, help="the big ranker's queries/hour at the peak")
    parser.add_argument("--canary-peak", type=float, default=20.0, help="the canary's queries/hour at the peak")
    parser.add_argument("--keep", metavar="DIR", help="keep the scrapes, TSDB and logs here (one folder per seed)")
    args = parser.parse_args(argv)
    bootstrap = os.environ.get("RANKMETER_KAFKA_BOOTSTRAP_SERVERS")
    redis_url = os.environ.get("RANKMETER_REDIS_URL")
    if not bootstrap or not redis_url:
        raise SystemExit("set RANKMETER_KAFKA_BOOTSTRAP_SERVERS and RANKMETER_REDIS_URL "
                         "(set -a; eval \"$(scripts/services.sh env)\"; set +a)")
    seeds = args.seed or [11]
    false_pages: list[Firing] = []
    delays: list[tuple[Injected, int | None]] = []
    quiet_days = 0.0
    for seed in seeds:
        result = measure(seed, args.days, args.peak, args.canary_peak, bootstrap, redis_url,
                         Path(args.keep) / f"seed-{seed}" if args.keep else None)
        print("\n".join(result.lines if len(seeds) == 1 else [f"## Seed {seed}", *result.lines[:-3], ""]), flush=True)
        false_pages += result.false_pages
        delays += result.delays.items()
        quiet_days += result.quiet_days
    if len(seeds) > 1:
        print("\n".join([f"## All {len(seeds)} seeds ({', '.join(map(str, seeds))}): {args.days * len(seeds):g} days",
                         *summary(quiet_days, false_pages, delays)]))
    return 0


class Result(NamedTuple):
    lines: list[str]
    quiet_days: float
    false_pages: list[Firing]
    delays: dict[Injected, int | None]
    firings: list[Firing]
    injected: list[Injected]


def measure(seed: int, days: float, peak: float, canary_peak: float, bootstrap: str, redis_url: str,
            keep: Path | None = None, plan: Callable[[int], Sequence[Injected]] | None = None,
            end_ms: int = END_MS) -> Result:
    """The whole measurement; `plan(start_ms)` gives the regressions (default `schedule`).
    The history ends at `end_ms`, a fixed time by default: a seed gives the same traffic,
    hours and weekdays on every run."""
    rules = yaml.safe_load(RULES.read_text())
    workdir = keep or Path(tempfile.mkdtemp(prefix="alert-quality-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    start_ms = end_ms - int(days * DAY_MS) // MINUTE_MS * MINUTE_MS
    calibration: list[str] = []
    if plan is not None:
        injected = list(plan(start_ms))
    else:
        ranking, clicks, calibration = calibrate(seed)
        print("\n".join(calibration), file=sys.stderr, flush=True)
        injected = schedule(int(days), start_ms, seed, ranking, clicks)
    history = History(start_ms, end_ms, {BIG: peak, CANARY: canary_peak}, click_model=CLICK_MODEL,
                      regressions=[r.regression for r in injected], seed=seed, run_id=f"s{seed}")
    run_id = f"{seed}-{os.getpid()}-{int(time.time())}"
    replayer = Replay(bootstrap, redis_url, workdir, run_id)
    samples = Samples(f"127.0.0.1:{replayer.port}")
    try:
        replay(history, start_ms, end_ms, samples, replayer)
    finally:
        replayer.close()
    replayed_s = time.monotonic() - t0
    prometheus = backfill(samples, rules, start_ms, end_ms, workdir)
    try:
        firings = evaluate_alerts(prometheus, rules, start_ms, end_ms)
    finally:
        prometheus.stop()
    false_pages, false_warnings, delays = score(firings, injected, quiet_grace_ms(rules))
    lines = report(rules, samples, start_ms, days, injected, firings, false_pages, false_warnings, delays,
                   history, replayed_s, time.monotonic() - t0)
    if keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    quiet_days = days - len(injected) * (2 * HOUR_MS + quiet_grace_ms(rules)) / DAY_MS
    return Result(calibration + lines, quiet_days, false_pages, delays, firings, list(injected))


def quiet_grace_ms(rules: Mapping) -> int:
    """How long after a regression an alert about it may still start: the longest alert
    window (1h) holds regressed queries that long, plus the longest `for:`."""
    return HOUR_MS + max(duration_s(r.get("for", "0s")) for g in rules["groups"] for r in g["rules"]
                         if "alert" in r) * 1000


def report(rules: Mapping, samples: Samples, start_ms: int, days: float, injected: Sequence[Injected],
           firings: Sequence[Firing], false_pages: Sequence[Firing], false_warnings: Sequence[Firing],
           delays: Mapping[Injected, int | None], history: History, replayed_s: float, total_s: float) -> list[str]:
    def when(t_ms: int) -> str:
        return f"day {(t_ms - start_ms) // DAY_MS} {time.strftime('%H:%M', time.gmtime(t_ms / 1000))}"

    lines = [f"# Alert quality: {days:g} days, {history.queries:,} queries, {history.events:,} events "
             f"(replayed in {replayed_s:.0f} s, {total_s:.0f} s in all)", "",
             "Regressions on " + BIG + ":"]
    for r in injected:
        d = delays[r]
        first = min((f for f in firings if f.severity == "page" and d is not None
                     and f.start_ms == r.start_ms + d and f.labels.get("ranker") == r.regression.ranker),
                    key=lambda f: f.alert, default=None)
        lines.append(f"  {r.label:<13} {when(r.start_ms)} for 2 h{realised(samples, r, injected)}: "
                     + (f"detected after {d / 60_000:.0f} min by {first.alert}" if first else "MISSED"))
    lines += ["", "Alerts that fired (ranker: count, severity):"]
    names = sorted({f.alert for f in firings})
    for name in names:
        mine = [f for f in firings if f.alert == name]
        by = {}
        for f in mine:
            by.setdefault((f.labels.get("ranker", "-"), f.severity), []).append(f)
        lines.append(f"  {name}: " + ", ".join(f"{ranker}: {len(fs)} {sev}" for (ranker, sev), fs in sorted(by.items())))
    if not names:
        lines.append("  none")
    grace_min = (grace_ms := quiet_grace_ms(rules)) // 60_000
    lines += ["", f"False pages (starting outside the regressions and the {grace_min} min after them):"]
    lines += [f"  {f.alert} {f.labels.get('ranker', '')} at {when(f.start_ms)} for "
              f"{(f.end_ms - f.start_ms) / 60_000 + 1:.0f} min" for f in false_pages] or ["  none"]
    lines += [f"Other alerts outside the regressions (tickets, warnings): {len(false_warnings)}"]
    lines += [f"  {f.alert} {f.severity} {f.labels.get('ranker', f.labels.get('topic', ''))} at {when(f.start_ms)}"
              for f in false_warnings]
    lines += ["", "Noise floor (the rules' constants against the measured standard errors):"]
    lines += noise_floor(samples, rules)
    quiet_days = days - len(injected) * (2 * HOUR_MS + grace_ms) / DAY_MS
    lines += [""] + summary(quiet_days, false_pages, list(delays.items()))
    return lines


def summary(quiet_days: float, false_pages: Sequence[Firing], delays: Sequence[tuple[Injected, int | None]]
            ) -> list[str]:
    """Detections per kind of regression, then the three figures: false pages per week of
    time without a regression (with its exact 95% Poisson interval), regressions missed,
    and the median delay counting a missed regression as never detected."""
    from scipy import stats

    lines = []
    for label in sorted({r.label for r, _ in delays}):
        found = [d / 60_000 for r, d in delays if r.label == label and d is not None]
        total = sum(r.label == label for r, _ in delays)
        lines.append(f"{label}: {len(found)} of {total} detected"
                     + (f", median {statistics.median(found):.0f} min" if found else ""))
    k, weeks = len(false_pages), quiet_days / 7
    low = stats.chi2.ppf(0.025, 2 * k) / 2 if k else 0.0
    high = stats.chi2.ppf(0.975, 2 * k + 2) / 2
    minutes = [math.inf if d is None else d / 60_000 for _, d in delays]
    return lines + [
        f"false_pages_per_week={k / weeks:.2f} (95% CI {low / weeks:.2f}-{high / weeks:.2f}, "
        f"{k} in {quiet_days:.1f} days without a regression)",
        f"missed_regressions={sum(d is None for _, d in delays)} (of {len(delays)})",
        f"median_detection_minutes={statistics.median(minutes):.1f}" if minutes else "median_detection_minutes=nan"]


if __name__ == "__main__":
    sys.exit(main())
