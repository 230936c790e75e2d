"""Settings: a YAML file (`--config` or RANKMETER_CONFIG), every value overridable by a
`RANKMETER_<SECTION>_<KEY>` environment variable (RANKMETER_KAFKA_BOOTSTRAP_SERVERS,
RANKMETER_REDIS_URL, RANKMETER_METRICS_PORT, …). Invalid settings fail at start with
one line naming the setting (`ConfigError`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import msgspec
import yaml

from rankmeter.ab import declared
from rankmeter.engine import ONLINE_SIGNALS, parse_all
from rankmeter.environment import coerce, overrides


class ConfigError(Exception):
    """An invalid setting, phrased for one line."""


KAFKA_BACKENDS = ("kafka-python", "confluent")
# Every grade, a judgment's or the configuration's, is 0 <= g <= MAX_GRADE: a sum of gains
# then stays finite (two judgments of 1e308 made a bucket's micro nDCG inf/inf).
MAX_GRADE = 1000.0


class Kafka(msgspec.Struct, forbid_unknown_fields=True):
    bootstrap_servers: str = "localhost:9092"
    group_id: str = "rankmeter"
    impressions_topic: str = "rankmeter.impressions"
    feedback_topic: str = "rankmeter.feedback"
    dead_letter_topic: str = "rankmeter.dlq"
    # Passed to kafka-python as they are: security_protocol, sasl_mechanism,
    # sasl_plain_username, sasl_plain_password, ssl_cafile, ssl_certfile, ssl_keyfile, …
    # (the confluent backend maps them to librdkafka's names: kafka/common.py).
    client: dict[str, Any] = {}
    max_poll_records: int = 5000
    poll_timeout_ms: int = 200
    # After a batch that was not full, the next gathers for this long from the previous poll:
    # a batch per record (caught up) would cost a Redis and a Kafka commit an event.
    gather_ms: int = 10
    # The Kafka client: kafka-python (the default, always installed) or confluent
    # (librdkafka, `pip install 'rankmeter[confluent]'`: faster, fetches in its own threads).
    backend: str = "kafka-python"
    # When a stored offset is no longer in the log (the topic recreated, records deleted
    # before they were read): `refuse` the partition (not ready, naming it) or `resume`
    # from the new log, the gap counted (pipeline/offsets.py).
    on_offsets_reset: str = "refuse"


class Redis(msgspec.Struct, forbid_unknown_fields=True):
    url: str = "redis://localhost:6379/0"  # rediss:// and redis://:password@host work
    key_prefix: str = "rankmeter"
    cluster: bool = False  # url names one node of a Redis Cluster; the rest are discovered
    # Redis evicting keys (any maxmemory-policy but noeviction) would lose state piecemeal:
    # `refuse` to start on such a Redis, or `warn` and go on.
    eviction_policy_check: str = "refuse"


class Metrics(msgspec.Struct, forbid_unknown_fields=True):
    port: int = 9108
    bind_address: str = "0.0.0.0"


class Evaluation(msgspec.Struct, forbid_unknown_fields=True):
    measures: list[str] = msgspec.field(default_factory=lambda: ["nDCG@10", "P@10", "AP", "RR", "R@10"])
    relevance_level: float = 1.0
    # `skip` averages quality measures over queries with a relevant document known;
    # `zero` counts every query, unjudged ones as 0 (brief §5).
    empty_query_policy: str = "skip"
    grades: dict[str, float] = msgspec.field(
        default_factory=lambda: {"click": 1.0, "add_to_cart": 2.0, "purchase": 3.0})
    long_dwell_ms: int = 30_000    # a click with at least this dwell ...
    long_dwell_grade: float = 2.0  # ... has this grade
    reject_unknown_actions: bool = False  # else counted `ignored`
    # A judgment may carry a label instead of a grade: Amazon ESCI's, by default.
    labels: dict[str, float] = msgspec.field(default_factory=lambda: {
        "Exact": 3.0, "Substitute": 2.0, "Complement": 1.0, "Irrelevant": 0.0,
        "E": 3.0, "S": 2.0, "C": 1.0, "I": 0.0})


class Windows(msgspec.Struct, forbid_unknown_fields=True):
    # The shipped alerts read 15m, 1h and 24h (deploy/prometheus/rules.yml).
    sizes: list[str] = msgspec.field(default_factory=lambda: ["5m", "15m", "1h", "24h"])
    attribution: str = "30m"   # feedback is accepted this long after the impression ...
    grace: str = "5m"          # ... plus this
    # Explicit judgments (editors) are accepted this long after the impression: by default
    # as long as the largest default window shows the query. Records stay in the store as
    # long, so this sets the store's size (docs/delivery.md).
    judgments: str = "24h"
    max_past: str = "7d"       # older event timestamps are invalid
    max_future: str = "1h"     # so are timestamps further ahead than this
    # A list assembled from a query's impression events (UBI records without hit ids) is
    # evaluated once the query record's time plus this has passed in event time.
    list_settle: str = "10s"


class Limits(msgspec.Struct, forbid_unknown_fields=True):
    max_results: int = 1000
    max_events_per_query: int = 10_000  # further feedback for the query is dead-lettered
    max_rankers: int = 20     # further rankers are folded into `other`
    max_segments: int = 20    # so are further segment values
    max_experiments: int = 20  # further interleaving experiments are not counted
    label_idle: str = "7d"    # a ranker or segment unseen this long frees its place under the cap
    ubi_ranker_attribute: str = "ranker"
    # query_attributes.<this>: how many results a UBI query record without hit ids showed;
    # its list is complete once that many documents have impression events.
    ubi_hits_attribute: str = "hits"


MAX_CUPED_BUCKETS = 1 << 20  # 16 MiB a measure per process at most


class AB(msgspec.Struct, forbid_unknown_fields=True):
    """An A/B experiment: every ranker other than the baseline is compared with it."""
    baseline: str = ""          # the control ranker; empty: no experiment
    unit: str = ""              # what is randomised: query, or user (sticky by client_id); required with baseline
    split: dict[str, float] = {}  # expected traffic share per ranker (the sample-ratio check)
    alpha: float = 0.05
    mixture_variance: float = 0.0  # τ² of the mSPRT mixture for every metric; 0: per metric, below
    mixture_scale: float = 1e-3  # τ² as a multiple of each metric's per-query variance, fixed at its first look ...
    mixture_after: str = ""     # ... this long after the phase's start or later; empty: 2 × (attribution + grace)
    min_queries: int = 100      # per arm, before any statistic is exported
    start: str = ""             # epoch ms or RFC 3339: when traffic started going to the treatments
    split_since: str = ""       # when the current split took effect (a ramp: a new phase); empty: start
    interleaving_start: str = ""  # interleaved impressions before it are not counted; part of their identity
    # The declared decision (ab/declared.py): "nDCG@10 increase"; guardrails "Abandonment 0.01", "CTR micro 2%".
    primary: list[str] = []
    guardrails: list[str] = []
    # CUPED (ab/cuped.py): macro comparisons adjusted by the query text's (or user's) pre-period mean.
    cuped: bool = False
    cuped_buckets: int = 65_536   # hash buckets of the pre-period table (collisions merge texts, or users)
    cuped_covariate: str = "text"  # x: the query text's pre-period mean, or (ab.unit: user) the user's


class Alerts(msgspec.Struct, forbid_unknown_fields=True):
    # Rankers whose quality alerts page (exported as rankmeter_ranker_info{role="production"});
    # the others (canaries, A/B treatments) only warn. Empty: every ranker is production.
    production_rankers: list[str] = []


class Debias(msgspec.Struct, forbid_unknown_fields=True):
    """Position-bias correction (debias/): examination propensities estimated from the
    stream, and inverse-propensity-weighted variants of graded measures, exported as
    rankmeter_debiased_quality{grading="ipw"} beside the raw ones."""
    measures: list[str] = msgspec.field(default_factory=lambda: ["nDCG@10"])  # empty: off
    ranks: int = 10               # propensities estimated for ranks 1..ranks
    max_weight: float = 10.0      # IPW clip: a click counts at most this many times
    min_pairs: int = 100          # harvested (query, document) pairs a rank needs for an estimate
    capacity: int = 50_000        # (query text, document) entries in each process's harvest table
    # Per-segment curves (debias/segments.py), off by default: a segment with thousands of
    # query texts rarely reaches support in its table, and the harvest costs up to 2.7x
    # (docs/debiasing.md). On, a segment gets its own when its harvest has this many pairs
    # at every rank; each segment label's table holds this many entries.
    segment_curves: bool = False
    segment_min_pairs: int = 1000
    segment_capacity: int = 2000
    # The share of queries harvested (by a hash of query_id): the estimate needs thousands,
    # not every one, and harvesting costs about 40 µs a query.
    harvest_share: float = 0.25


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    kafka: Kafka = msgspec.field(default_factory=Kafka)
    redis: Redis = msgspec.field(default_factory=Redis)
    metrics: Metrics = msgspec.field(default_factory=Metrics)
    evaluation: Evaluation = msgspec.field(default_factory=Evaluation)
    windows: Windows = msgspec.field(default_factory=Windows)
    limits: Limits = msgspec.field(default_factory=Limits)
    ab: AB = msgspec.field(default_factory=AB)
    alerts: Alerts = msgspec.field(default_factory=Alerts)
    debias: Debias = msgspec.field(default_factory=Debias)
    log_level: str = "INFO"


SECTIONS: dict[str, type[msgspec.Struct]] = {
    "kafka": Kafka, "redis": Redis, "metrics": Metrics, "evaluation": Evaluation,
    "windows": Windows, "limits": Limits, "ab": AB, "alerts": Alerts,
    "debias": Debias}

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def duration_ms(text: str) -> int:
    """`500ms`, `30s`, `5m`, `1h`, `7d`, and sums of them (`2d14h`, `1h30m`) -> milliseconds."""
    text = text.strip()
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h, 7d or 2d14h")
    return int(sum(float(n) * _UNIT_MS[u] for n, u in parts))


def time_ms(text: str) -> int:
    """Epoch milliseconds, or an RFC 3339 time (`2026-12-01T09:00:00Z`) -> milliseconds."""
    if text.strip().isdigit():
        return int(text)
    return int(datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp() * 1000)


def _check_time(name: str, text: str, fail: Callable[[str, str], None]) -> None:
    if not text:
        return
    try:
        time_ms(text)
    except ValueError:
        fail(name, f"{text!r} is neither epoch milliseconds nor an RFC 3339 time")
    if not text.strip().isdigit() and datetime.fromisoformat(text.strip().replace("Z", "+00:00")).tzinfo is None:
        # Read in each host's local time, replicas in different zones would name
        # different experiments; read as UTC, a running one would be renamed.
        fail(name, f"{text!r} has no time zone: add Z (UTC) or an offset such as +01:00")


def load(path: str | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The file (if any) under the environment's overrides, validated."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("RANKMETER_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read configuration {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"configuration {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"configuration {path}: expected a mapping of sections")
    for section, values in overrides(environ, SECTIONS).items():
        if section == "log_level":
            data["log_level"] = values
            continue
        struct = SECTIONS[section]
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"invalid configuration: {section}: expected a mapping")
        for key, value in values.items():
            if key not in struct.__struct_fields__:
                raise ConfigError(f"invalid configuration: unknown setting RANKMETER_{section.upper()}_{key.upper()}")
            try:
                target[key] = coerce(struct, key, value)
            except ValueError as e:
                raise ConfigError(f"invalid configuration: {e}") from None
    try:
        settings = msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid configuration: {_setting_name(str(e))}") from None
    _check(settings)
    return settings


def _setting_name(message: str) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.metrics.port`": lead with the setting.
    m = re.search(r" - at `\$\.?(.*)`$", message)
    if m:
        return f"{m[1]}: {message[:m.start()]}"
    return message


def _check(s: Settings) -> None:
    def fail(setting: str, problem: str) -> None:
        raise ConfigError(f"invalid configuration: {setting}: {problem}")

    for name in ("attribution", "grace", "judgments", "max_past", "max_future", "list_settle"):
        try:
            duration_ms(getattr(s.windows, name))
        except ValueError as e:
            fail(f"windows.{name}", str(e))
    try:
        idle = duration_ms(s.limits.label_idle)
    except ValueError as e:
        fail("limits.label_idle", str(e))
    longest = max((duration_ms(w) for w in s.windows.sizes), default=0) + duration_ms(s.windows.judgments)
    if idle < longest:
        # A freed place reused while the old value's buckets still show would export more
        # series than the cap.
        fail("limits.label_idle", f"must be at least the largest window plus windows.judgments ({longest // 60_000} min)")
    if s.redis.eviction_policy_check not in ("refuse", "warn"):
        fail("redis.eviction_policy_check", "must be refuse or warn")
    if not s.windows.sizes:
        fail("windows.sizes", "at least one window is needed")
    for size in s.windows.sizes:
        try:
            if duration_ms(size) < 60_000:
                fail("windows.sizes", f"{size!r} is shorter than the one-minute bucket")
        except ValueError as e:
            fail("windows.sizes", str(e))
    try:
        parse_all(s.evaluation.measures)
    except ValueError as e:
        fail("evaluation.measures", str(e))
    if s.evaluation.empty_query_policy not in ("skip", "zero"):
        fail("evaluation.empty_query_policy", "must be skip or zero")
    if any(not 0 <= g <= MAX_GRADE for g in s.evaluation.grades.values()):
        fail("evaluation.grades", f"grades must be from 0 to {MAX_GRADE:g}")
    if not 0 <= s.evaluation.long_dwell_grade <= MAX_GRADE:
        fail("evaluation.long_dwell_grade", f"must be from 0 to {MAX_GRADE:g}")
    if "judgment" in s.evaluation.grades:
        fail("evaluation.grades", "`judgment` takes its grade from the event, not the map")
    if "impression" in s.evaluation.grades:
        fail("evaluation.grades", "`impression` events place documents in lists; they have no grade")
    if any(not 0 <= g <= MAX_GRADE for g in s.evaluation.labels.values()):
        fail("evaluation.labels", f"grades must be from 0 to {MAX_GRADE:g}")
    if not 0 < s.metrics.port < 65536:
        fail("metrics.port", f"{s.metrics.port} is not a TCP port")
    if not s.redis.url.startswith(("redis://", "rediss://", "unix://")):
        fail("redis.url", "must start with redis://, rediss:// or unix://")
    for name in ("max_results", "max_events_per_query", "max_rankers", "max_segments", "max_experiments"):
        if getattr(s.limits, name) < 1:
            fail(f"limits.{name}", "must be at least 1")
    if not 0 < s.ab.alpha < 1:
        fail("ab.alpha", "must be between 0 and 1")
    if not (math.isfinite(s.ab.mixture_variance) and s.ab.mixture_variance >= 0):
        fail("ab.mixture_variance", "must be a number >= 0 (0: per metric, ab.mixture_scale)")
    if not (math.isfinite(s.ab.mixture_scale) and s.ab.mixture_scale > 0):
        fail("ab.mixture_scale", "must be a number > 0")
    if s.ab.mixture_after:
        try:
            duration_ms(s.ab.mixture_after)
        except ValueError as e:
            fail("ab.mixture_after", str(e))
    if s.ab.min_queries < 2:
        fail("ab.min_queries", "must be at least 2")
    if not 2 <= s.ab.cuped_buckets <= MAX_CUPED_BUCKETS:
        fail("ab.cuped_buckets", f"must be from 2 to {MAX_CUPED_BUCKETS} (16 bytes a bucket and measure)")
    if s.ab.cuped and not s.ab.baseline:
        fail("ab.cuped", "needs an experiment (ab.baseline, ab.start): its covariate is the pre-period before ab.start")
    if s.ab.cuped_covariate not in ("text", "user"):
        fail("ab.cuped_covariate", "must be text (the query text's pre-period mean) or user (the user's)")
    if s.ab.cuped_covariate == "user" and s.ab.unit != "user":
        fail("ab.cuped_covariate", "user needs ab.unit: user (a user's pre-period mean, with users assigned whole)")
    if any(share <= 0 for share in s.ab.split.values()):
        fail("ab.split", "shares must be > 0")
    if s.ab.baseline and not s.ab.start:
        # Enrolment must depend on an impression's time alone, not on the order in which
        # partitions and replicas happen to see the first impression of a treatment.
        fail("ab.start", "required with ab.baseline: when traffic started going to the treatments "
                         "(epoch ms or RFC 3339)")
    if s.ab.baseline and s.ab.unit not in ("query", "user"):
        fail("ab.unit", "required with ab.baseline: query (each query assigned on its own) or user "
                        "(each user's queries to one arm, by client_id)")
    for name in ("start", "split_since", "interleaving_start"):
        _check_time(f"ab.{name}", getattr(s.ab, name), fail)
    try:
        known = frozenset(str(m) for m in parse_all(s.evaluation.measures)) | frozenset(ONLINE_SIGNALS)
        declared.parse(s.ab.primary, s.ab.guardrails, known)
    except ValueError as e:
        setting, _, problem = str(e).partition(": ")
        fail(setting, problem)
    if s.ab.split_since and (not s.ab.start or time_ms(s.ab.split_since) < time_ms(s.ab.start)):
        fail("ab.split_since", "needs ab.start, and must not be before it")
    try:
        debiased = parse_all(s.debias.measures)
    except ValueError as e:
        fail("debias.measures", str(e))
    for m in debiased:
        if m.family not in ("nDCG", "DCG") or dict(m.params).get("dcg", "log2") != "log2" or m.cutoff is None:
            fail("debias.measures", f"{m}: only nDCG@k and DCG@k (with a cut-off, linear gains) have an IPW variant")
        elif m.cutoff > s.debias.ranks:
            fail("debias.measures", f"{m}: the cut-off is beyond debias.ranks ({s.debias.ranks}), "
                                    f"the ranks whose propensities are estimated")
    if not 1 <= s.debias.ranks <= 100:
        fail("debias.ranks", "must be between 1 and 100")
    if s.debias.max_weight < 1:
        fail("debias.max_weight", "must be at least 1")
    if not 0 < s.debias.harvest_share <= 1:
        fail("debias.harvest_share", "must be in (0, 1]")
    if s.debias.min_pairs < 1 or s.debias.capacity < 1:
        fail("debias.min_pairs" if s.debias.min_pairs < 1 else "debias.capacity", "must be at least 1")
    if s.debias.segment_min_pairs < 1 or s.debias.segment_capacity < 1:
        fail("debias.segment_min_pairs" if s.debias.segment_min_pairs < 1 else "debias.segment_capacity",
             "must be at least 1")
    if s.kafka.max_poll_records < 1:
        fail("kafka.max_poll_records", "must be at least 1")
    if not 0 <= s.kafka.gather_ms <= 1000:
        fail("kafka.gather_ms", "must be from 0 to 1000")
    if s.kafka.backend not in KAFKA_BACKENDS:
        fail("kafka.backend", f"must be {' or '.join(KAFKA_BACKENDS)}")
    if s.kafka.on_offsets_reset not in ("refuse", "resume"):
        fail("kafka.on_offsets_reset", "must be refuse or resume")
