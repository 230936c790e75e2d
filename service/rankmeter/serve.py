"""`rankmeter serve`: wires a source, the pipeline, a store and the exporter, and runs the
poll loop until SIGTERM or SIGINT (then finishes the batch, persists, closes the consumer)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from rankmeter import gc_tuning
from rankmeter.config import Settings
from rankmeter.exporter import Exporter, Health
from rankmeter.inflight import InFlight
from rankmeter.lag import Lag
from rankmeter.pipeline import Checkpoint, Pipeline
from rankmeter.source import Record, Source, SourceUnavailable
from rankmeter.store import Store

log = logging.getLogger("rankmeter.serve")

LAG_INTERVAL_S = 1.0
PROGRESS_INTERVAL_S = 10.0
AB_INTERVAL_S = 5.0               # how often the experiment's statistics are looked at, at most ...
AB_LOOK_SHARE = 0.1               # ... and no more of the consuming thread's time than this,
AB_MAX_INTERVAL_S = 60.0          # ... but at least this often
RECOVERY_BACKOFF_S = (0.5, 10.0)  # first and longest wait between tries to reach the store or the broker
DELIVERY_WAIT_S = 5.0             # how long a batch waits for its dead letters' acknowledgements at a time
LOOK_SLICE_S, IDLE_LOOK_SLICE_S = 0.002, 0.02  # the propensities' estimate (~0.1 s) a batch, an empty poll


class _Stopped(Exception):
    """Stopping while a batch waited for the broker: the batch is not stored (replayed on restart)."""


def dead_letter_headers(record: Record, reason: str) -> list[tuple[str, bytes]]:
    """Why and where from, beside the message's own headers."""
    return [*(record.headers or []), ("rankmeter.reason", reason.encode()),
            ("rankmeter.source.topic", record.topic.encode()),
            ("rankmeter.source.partition", str(record.partition).encode()),
            ("rankmeter.source.offset", str(record.offset).encode())]


def run(settings: Settings, source: Source, store: Store, stop: threading.Event | None = None,
        on_start: Callable[[Pipeline, int], None] | None = None, rebuild: bool = False,
        clock: Callable[[], float] = time.time) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT when on the main thread).
    `on_start(pipeline, metrics_port)` is called once consuming starts (the demo uses it).
    `rebuild`: partitions whose stored state is lost are rebuilt from the topics instead
    of refused. `clock` is the wall clock (windows end at its now; tests shift it), or an
    `EventClock` (history replays: now is the newest record consumed)."""
    stop = stop or threading.Event()
    gc_tuning.tune()
    health = Health()
    k = settings.kafka
    pipeline = Pipeline(settings, store, _dead_letters(source, k.dead_letter_topic, health, stop), clock=clock,
                        bounds=source.bounds)
    lag = Lag(pipeline, clock)
    exporter = Exporter(pipeline.readout, health, lag.held, lag.seconds)
    port = exporter.start(settings.metrics.bind_address, settings.metrics.port)
    rebuilding = [rebuild]  # --rebuild applies to the partitions found lost at start, not later
    # The store failed: every partition is reloaded from it before the next batch. Not ready
    # (health.store_problem) until a batch is stored again: a full Redis takes a claim's few
    # bytes but not a batch's, and must not look ready in between.
    reload = [False]

    inflight = InFlight(source)  # a batch's commit outstanding while the next is polled and decoded
    done: list[Checkpoint] = []  # settled since the loop last looked (a rebalance callback settles too)
    last_lag = last_progress = last_ab = last_idle_sweep = gathered = time.monotonic()
    small = False  # the last batch was not full: the next one gathers for kafka.gather_ms
    ab_interval, consumed = AB_INTERVAL_S, 0
    failures = 0  # batches the store failed in a row: the wait before reloading grows with them
    full = False  # the last of them failed for want of memory
    paused: set[int] = set()

    def store_failed(e: Exception) -> None:
        # The batch may or may not be stored: reload every partition from the store (state
        # and offsets agree there) once it answers again.
        nonlocal failures, full
        health.store_problem = _store_problem(store, e)
        failures, full = failures + 1, isinstance(e, store.full)
        reload[0] = True
        log.error("the state store failed during a batch; reloading from it once it answers",
                  extra={"error": type(e).__name__, "reason": health.store_problem})

    def settle() -> None:
        """The checkpoint in flight confirmed, its offsets handed to Kafka; or its failure recorded."""
        try:
            checkpoint = inflight.settle()
        except store.unavailable as e:
            store_failed(e)
            return
        if checkpoint is not None:
            done.append(checkpoint)

    def after_settled() -> None:
        """What the settled checkpoints decided: the store healthy again, partitions to claim
        again, to rejoin for or to stop consuming (not in a rebalance callback)."""
        nonlocal failures, full, paused
        for checkpoint in done:
            if not reload[0] and (checkpoint.partitions or not full):
                # No claim failed meanwhile, and the store took a write (a full one takes a
                # claim, and an empty checkpoint writes nothing: only a stored batch proves it).
                failures, full, health.store_problem = 0, False, ""
        done.clear()
        if pipeline.rewound and not _reclaim(pipeline, source, health):
            reload[0] = True
        paused |= _refused(pipeline, source, paused)

    def on_assign(partitions: list[int]) -> dict[tuple[str, int], int]:
        settle()  # claims read the store: nothing of ours in flight meanwhile
        try:
            resume = pipeline.assign(partitions, source.committed(partitions), rebuilding[0],
                                     bounds=source.bounds(partitions))
        except store.unavailable as e:
            # The store is away (or full) while claiming: the partitions stay paused; the loop recovers.
            health.store_problem = _store_problem(store, e, "while loading partitions")
            reload[0] = True
            return {}
        rebuilding[0] = False
        health.ready = True
        lag.restart()  # positions restart at the stored offsets: earlier samples mean nothing now
        return resume

    def on_revoke(partitions: list[int]) -> None:
        settle()  # the batch in flight stored (or refused, or failed) before its partitions are forgotten
        pipeline.revoke(partitions)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    source.subscribe([k.impressions_topic, k.feedback_topic], on_assign, on_revoke)
    log.info("rankmeter serve started", extra={"metrics_port": port, "group": k.group_id,
                                               "topics": [k.impressions_topic, k.feedback_topic]})
    if on_start is not None:
        on_start(pipeline, port)
    try:
        while not stop.is_set():
            if reload[0]:
                settle()  # (a failure now is this reload's)
                done.clear()
                _recover(pipeline, source, health, stop, _backoff(failures))
                reload[0] = False
                lag.restart()
                continue
            # With a commit in flight, take only what the consumer holds already: in a quiet
            # spell a blocking poll would hold the batch's confirmation for its whole timeout.
            if small and (wait := k.gather_ms / 1000 - (time.monotonic() - gathered)) > 0 and stop.wait(wait):
                continue  # (kafka.gather_ms: caught up, a batch per record would cost a commit an event)
            records = source.poll(0 if inflight.outstanding else k.poll_timeout_ms, k.max_poll_records)
            gathered, small = time.monotonic(), 0 < len(records) < k.max_poll_records
            health.beat()
            _watch_source(source, health)
            batch = None
            # An empty poll still sweeps (at most every second): lists assembled from
            # impression events settle in a quiet spell too, also after a restart.
            if records or time.monotonic() - last_idle_sweep >= 1.0:
                last_idle_sweep = time.monotonic()
                started = time.perf_counter()
                lag.see(records)
                batch = pipeline.read(records)  # decoded while the previous batch's commit is in flight
            settle()
            after_settled()
            if reload[0]:
                continue  # (the batch read is read again from the stored offsets)
            # Nothing in flight now: the estimate's end reads the store and swaps the tables
            # the checkpoint's thread harvests into. A failure: the next look begins afresh.
            try:
                pipeline.advance_position_bias(LOOK_SLICE_S if records else IDLE_LOOK_SLICE_S)
            except Exception as e:  # (the store's failure: the next batch meets it and recovers)
                if not isinstance(e, store.unavailable):
                    log.exception("the propensities' estimate failed; the last one stays in use")
            if batch is not None:
                try:
                    checkpoint = pipeline.step(batch)  # the stages: sweep ... scoring
                    _deliver(source, k.dead_letter_topic, health, stop)  # its dead letters acknowledged
                    inflight.send(checkpoint)  # one commit to the store, all partitions; settled after the next poll
                except store.unavailable as e:
                    store_failed(e)
                    continue
                except _Stopped:
                    break
                except Exception:
                    # Memory may now be ahead of the store: only a restart, which resumes from
                    # the stored state and offsets, is safe.
                    log.exception("a batch failed; exiting so that a restart resumes from the stored offsets")
                    raise
                if records:
                    exporter.batch_duration.observe(time.perf_counter() - started)
                    exporter.batch_records.observe(len(records))
                consumed += len(records)
            health.lost_problem = _lost_problem(pipeline)
            now = time.monotonic()
            if now - last_lag >= LAG_INTERVAL_S or now - last_ab >= ab_interval:
                settle()  # the looks read the store and compare its marks with ours
                after_settled()
                if reload[0]:
                    continue
            if now - last_lag >= LAG_INTERVAL_S:
                lag.sample(source)
                last_lag = now
                if not _verify(pipeline, source, health):
                    reload[0] = True
            if now - last_ab >= ab_interval:
                last_ab = now
                began = time.monotonic()
                if _look_at_experiment(pipeline, store.unavailable):  # (a failed one says nothing of its cost)
                    ab_interval = _next_look_interval(time.monotonic() - began, ab_interval)
            if now - last_progress >= PROGRESS_INTERVAL_S:
                log.info("progress", extra={"records": consumed, "per_second": round(consumed / (now - last_progress)),
                                            "lag": lag.total(), "open_queries": pipeline.open_queries()})
                consumed, last_progress = 0, now
    finally:
        log.info("stopping: the last batch is persisted; closing the consumer")
        settle()
        inflight.close()
        source.close()
        store.close()
        exporter.stop()
        gc_tuning.untune()


def _dead_letters(source: Source, topic: str, health: Health, stop: threading.Event
                  ) -> Callable[[Record, str], None]:
    def dead_letter(record: Record, reason: str) -> None:
        # The producer buffers while the broker is away; when it cannot take more, the batch
        # waits here (alive, not ready) rather than fail: nothing of it is stored yet.
        delay = RECOVERY_BACKOFF_S[0]
        while True:
            try:
                source.produce(topic, record.key, record.value, dead_letter_headers(record, reason))
                return
            except SourceUnavailable as e:
                health.source_problem = f"Kafka unavailable: {e}"
                log.warning("the dead-letter topic cannot take a message; retrying",
                            extra={"error": str(e), "retry_in_s": delay})
            health.beat()
            if stop.wait(delay):
                raise _Stopped
            delay = min(delay * 2, RECOVERY_BACKOFF_S[1])
    return dead_letter


def _deliver(source: Source, topic: str, health: Health, stop: threading.Event) -> None:
    """The batch's dead letters acknowledged before its checkpoint is stored: the stored
    offsets never pass an invalid record whose dead letter could still be lost (a SIGKILL,
    a refused send). Until then the batch waits, unstored (alive, not ready), with backoff."""
    delay = RECOVERY_BACKOFF_S[0]
    while not source.delivered(DELIVERY_WAIT_S):
        health.source_problem = f"Kafka unavailable: the dead-letter topic {topic!r} has not acknowledged " \
                                f"the batch's dead letters"
        log.warning("dead letters not acknowledged; the batch waits", extra={"topic": topic, "retry_in_s": delay})
        health.beat()
        if stop.wait(delay):
            raise _Stopped
        delay = min(delay * 2, RECOVERY_BACKOFF_S[1])


def _store_problem(store: Store, e: Exception, when: str = "") -> str:
    """What /readyz says while the store fails: away, or full (maxmemory with noeviction)."""
    when = f" {when}" if when else ""
    if isinstance(e, getattr(store, "full", ())):
        return (f"redis is full (maxmemory reached, policy noeviction){when}: nothing is stored until "
                f"memory is freed or maxmemory raised")
    return f"state store unavailable{when}: {type(e).__name__}"


def _refused(pipeline: Pipeline, source: Source, paused: set[int]) -> set[int]:
    """After a batch: rejoin the group when a partition was fenced; stop reading those
    whose state was lost while consumed. Returns the partitions paused now."""
    if pipeline.fenced:
        pipeline.revoke(list(pipeline.partitions))
        pipeline.fenced.clear()
        source.rejoin()
    refused = pipeline.lost | set(pipeline.stopped)
    if refused - paused:
        source.pause(sorted(refused - paused))
        return refused
    return set()


def _next_look_interval(took_s: float, interval_s: float) -> float:
    """A look reads every partition's arm sums (with ab.unit: user, 128 fields per arm and
    segment each): at many partitions, rankers and segments it takes seconds, on the
    consuming thread. Spaced so that looks take at most AB_LOOK_SHARE of it; logged when
    the interval grows by half or more."""
    wanted = min(AB_MAX_INTERVAL_S, max(AB_INTERVAL_S, took_s / AB_LOOK_SHARE))
    if wanted > AB_INTERVAL_S and wanted > 1.5 * interval_s:
        log.warning("the experiment's look is slow: looking less often", extra={
            "look_seconds": round(took_s, 3), "interval_seconds": round(wanted, 1)})
    return wanted


def _look_at_experiment(pipeline: Pipeline, unavailable: tuple[type[Exception], ...]) -> bool:
    """The experiment's statistics are global (every partition's sums): the replica that
    holds partition 0 computes and exports them, the others export none. False when the
    store failed it."""
    try:
        # Every replica weighs the debiased measures with the same propensities: partition
        # 0's holder estimates them, the others read its estimate.
        pipeline.look_at_position_bias(estimate_here=0 in pipeline.partitions, now=time.time(), budget_s=LOOK_SLICE_S)
        # Every replica: CUPED means in the store that are not its own (it lost them, another
        # process stored others) followed within a look's interval, not at the next claim.
        pipeline.experiments.covariates.resolve()
        if 0 not in pipeline.partitions:
            pipeline.experiments.forget()
            return True
        pipeline.ab_look()
    except unavailable:
        return False  # the next batch meets the store's failure and recovers
    return True


def _watch_source(source: Source, health: Health) -> None:
    """Not ready while the broker is out of reach; the client reconnects by itself."""
    problem = source.problem()
    if problem and not health.source_problem:
        log.warning("Kafka is out of reach: not ready until it answers", extra={"reason": problem})
    elif health.source_problem and not problem:
        log.info("Kafka answers again")
    health.source_problem = problem


def _lost_problem(pipeline: Pipeline) -> str:
    problems = []
    if pipeline.lost:
        problems.append(f"state lost for partitions {sorted(pipeline.lost)}: not consuming them; "
                        f"restart with `rankmeter serve --rebuild` to rebuild them from the topics")
    if stopped := dict(pipeline.stopped):
        problems.append(f"offsets reset for partitions {sorted(stopped)}: not consuming them "
                        f"({'; '.join(stopped[p] for p in sorted(stopped))}); set kafka.on_offsets_reset: "
                        f"resume to go on from the new log")
    return "; ".join(problems)


def _verify(pipeline: Pipeline, source: Source, health: Health) -> bool:
    """Once a second: the store still holds the held partitions' last checkpoints (an idle
    partition commits nothing that could be refused); claim again those it lost. False:
    reclaiming failed, reload every partition once the store answers."""
    try:
        pipeline.verify()
    except pipeline.store.unavailable:
        return True  # the next batch meets the store's failure and recovers
    return not pipeline.rewound or _reclaim(pipeline, source, health)


def _reclaim(pipeline: Pipeline, source: Source, health: Health) -> bool:
    """The store lost the last checkpoints of some partitions (their commit was refused and
    they were dropped): claim them again from what it holds, and read Kafka again from there;
    the other partitions go on where they are."""
    assigned = set(source.assigned())
    rewound = sorted(pipeline.rewound & assigned)
    pipeline.ledger.rewound &= assigned  # those revoked since are the next owner's to claim
    pipeline.ledger.recheck &= assigned
    pipeline.revoke(rewound)  # dropped already, but those rechecked
    try:
        resume = pipeline.assign(rewound, source.committed(rewound), bounds=source.bounds(rewound))
    except Exception as e:  # the store or the broker away: reload everything once they answer
        problem = f"reclaiming partitions after lost writes failed: {type(e).__name__}"
        if isinstance(e, pipeline.store.unavailable):
            health.store_problem = problem
        else:  # the broker (a topic's bounds, its commit)
            health.source_problem = problem
        return False
    source.seek({**pipeline.positions(), **resume})
    return True


def _backoff(failures: int) -> float:
    """How long to wait before reloading after this many failed batches in a row: none after
    the first (Redis restarted), then growing, bounded (a full Redis fails every batch)."""
    return 0.0 if failures <= 1 else min(RECOVERY_BACKOFF_S[0] * 2 ** (failures - 2), RECOVERY_BACKOFF_S[1])


def _recover(pipeline: Pipeline, source: Source, health: Health, stop: threading.Event, wait_s: float = 0.0) -> None:
    """Wait for the store with bounded backoff (staying alive, not ready), then reload
    the assigned partitions from it and resume the consumer at the stored offsets."""
    pipeline.revoke(list(pipeline.partitions), reclaiming=True)
    health.beat()
    if wait_s:
        log.warning("the state store failed again; waiting before reloading", extra={"retry_in_s": wait_s})
        stop.wait(wait_s)
    delay = RECOVERY_BACKOFF_S[0]
    while not stop.is_set():
        health.beat()  # alive, but not ready
        try:
            partitions = source.assigned()
            source.seek(pipeline.assign(partitions, source.committed(partitions),
                                        bounds=source.bounds(partitions)))
        except Exception as e:  # the store, or the broker too: wait and try again
            if isinstance(e, pipeline.store.unavailable):
                health.store_problem = _store_problem(pipeline.store, e)
            log.warning("cannot reload the partitions yet; retrying", extra={"error": type(e).__name__,
                                                                            "retry_in_s": delay})
            stop.wait(delay)
            delay = min(delay * 2, RECOVERY_BACKOFF_S[1])
            continue
        log.info("state store answers again: partitions reloaded", extra={"partitions": partitions})
        return
