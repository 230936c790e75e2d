"""Issue 24's targets (which replace issue 10's) in one table, from the figures the
benchmarks left in bench/results/:

    .venv/bin/python bench/summary.py [--results bench/results]

Each benchmark writes its figures as JSON (`save(name, figures)`: bench/results/<name>.json,
or under $BENCH_RESULTS_DIR) when it finishes; this prints every target of issue 24, the
figure measured for it and whether it is met. A target whose benchmark has not run (or
ran without the backend it needs) says so. `make bench` runs every benchmark, then this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR", ROOT / "bench" / "results"))


def save(name: str, figures: dict) -> Path:
    """Write one benchmark's figures (with when and on which commit) for the summary."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    try:  # which rankmeter ran: the repository's (with uncommitted changes?) or PYTHONPATH's
        import rankmeter

        source = str(Path(rankmeter.__file__).resolve().parent)
    except ImportError:
        source = ""
    dirty = source.startswith(str(ROOT)) and bool(subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "service"], capture_output=True, text=True).stdout.strip())
    path = RESULTS / f"{name}.json"
    doc = {"bench": name, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "rankmeter_from": source, "service_uncommitted_changes": dirty,
           "load_average": os.getloadavg()[0], **figures}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True, default=float) + "\n")
    print(f"figures written to {path}", file=sys.stderr)
    return path


def load(directory: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(directory.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
    return out


def _get(doc: dict | None, *path, default=None):
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return default
        doc = doc[key]
    return doc


def _n(x: float | None, fmt: str = ",.0f") -> str:
    return "—" if x is None else format(x, fmt)


def rows(r: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """(target, measured, met, source) per target of issue 24 (issue 10's beyond throughput and freshness)."""
    out = []

    def row(target: str, measured: str, ok: bool | str | None, source: str) -> None:
        verdict = ok if isinstance(ok, str) else ("not run" if ok is None else ("met" if ok else "NOT met"))
        out.append((target, measured, verdict, source))

    serve = r.get("serve")
    cf, kp = _get(serve, "rankmeter_serve_confluent_events_per_second"), _get(serve, "rankmeter_serve_events_per_second")
    cpu = _get(serve, "cpu_us_per_event") or {}

    def cpu_of(key: str) -> str:
        return f", {cpu[key]:.1f} µs CPU/event" if key in cpu else ""

    row("serve end to end, confluent ≥ 100,000 events/s", f"{_n(cf)} /s{cpu_of('serve_confluent')}",
        None if cf is None else cf >= 100_000, "bench_serve")
    row("serve end to end, kafka-python ≥ 60,000 events/s", f"{_n(kp)} /s{cpu_of('serve')}",
        None if kp is None else kp >= 60_000, "bench_serve")
    ratio = _get(serve, "ratio_confluent")
    row("serve confluent ≥ 0.5 × bare confluent consumer", f"{_n(ratio, '.2f')} "
        f"({_n(cf)} vs {_n(_get(serve, 'bare_confluent_events_per_second'))} /s)",
        None if ratio is None else ratio >= 0.5, "bench_serve")
    quix = _get(serve, "ratio_best_serve_to_quix")
    row("best serve ≥ 4 × the Quix Streams peer", f"{_n(quix, '.2f')} × (Quix {_n(_get(serve, 'quix_peer_events_per_second'))} /s)",
        None if quix is None else quix >= 4, "bench_serve")
    for key, backend in (("serve_confluent", "confluent"), ("serve", "kafka-python")):
        us = cpu.get(key)
        row(f"serve's CPU ≤ 6 µs/event ({backend}; /proc, same run)", f"{_n(us, '.1f')} µs "
            f"(pipeline alone in memory {_n(cpu.get('pipeline'), '.1f')} µs)", None if us is None else us <= 6,
            "bench_serve")

    fresh = r.get("freshness")
    for backend in ("kafka_python", "confluent"):
        b = _get(fresh, "backends", backend)
        p99_5k, p99_80 = _get(b, "p99_ms_at_5000"), _get(b, "p99_ms_at_80pct")
        probes_5k, probes_80 = _get(b, "probes_at_5000"), _get(b, "probes_at_80pct")
        name = backend.replace('_', '-')
        # A p99 over fewer than 500 probes is (nearly) their maximum: not the target's figure.
        row(f"freshness p99 ≤ 150 ms at 5,000/s ({name}, ≥ 500 probes)",
            f"{_n(p99_5k)} ms (p50 {_n(_get(b, 'p50_ms_at_5000'))} ms, {_n(probes_5k)} probes)",
            None if p99_5k is None else p99_5k <= 150 and (probes_5k or 0) >= 500, "bench_freshness")
        # "Harvest on" only if the harvest ran during the level (an older run did not record it,
        # and its traffic never harvested): else the row is unmeasured, whatever the p99.
        harvested = _get(b, "harvested_at_80pct")
        row(f"freshness p99 ≤ 250 ms at 80% of max ({name}, harvest on, ≥ 500 probes)",
            f"{_n(p99_80)} ms at {_n(_get(b, 'rate_80pct'))} /s (p50 {_n(_get(b, 'p50_ms_at_80pct'))} ms, "
            f"{_n(probes_80)} probes, {_n(harvested)} queries harvested)",
            None if p99_80 is None else (p99_80 <= 250 and (probes_80 or 0) >= 500) if harvested else
            "unmeasured (no harvest)", "bench_freshness")
    per_query = [v for v in (_get(fresh, "backends", b, "redis_bytes_per_open_query")
                             for b in ("kafka_python", "confluent")) if v is not None]
    row("Redis bytes per open query ≤ 1 KiB", f"{_n(max(per_query)) if per_query else '—'} B",
        None if not per_query else max(per_query) <= 1024, "bench_freshness")

    soak = r.get("soak")
    for backend in ("confluent", "kafka_python"):
        s = _get(soak, "backends", backend)
        if s is None and soak is not None:
            continue
        spread = _get(s, "rss_max_deviation_after_warmup")
        row(f"RSS flat within 10% over the soak ({backend.replace('_', '-')})",
            "—" if s is None else
            f"{_get(s, 'events'):,} events: RSS {_n(_get(s, 'rss_mib_at_10pct'), '.0f')} / "
            f"{_n(_get(s, 'rss_mib_at_50pct'), '.0f')} / {_n(_get(s, 'rss_mib_at_100pct'), '.0f')} MiB at 10/50/100%, "
            f"at most {_n(100 * spread if spread is not None else None, '.1f')}% from the 10% figure "
            f"(peak to peak {_n(100 * (_get(s, 'rss_spread_after_warmup') or 0), '.1f')}%)",
            None if spread is None else spread <= 0.10, "bench_soak")

    scrape = r.get("scrape")
    ratios = _get(scrape, "scrape_ratios")
    if ratios:
        worst = max(ratios.values())
        row("scrape cost independent of open queries (100 rankers × 3 windows × 10 measures)",
            f"time ratio {_n(worst, '.2f')} at {_n(_get(scrape, 'high'))} vs {_n(_get(scrape, 'low'))} open queries "
            f"({_n(_get(scrape, 'series'))} series; worst format)", worst <= 1.2, "bench_scrape")
    else:
        row("scrape cost independent of open queries", "—", None, "bench_scrape")

    ev = r.get("eval")
    speed = _get(ev, "speedup_vs_pytrec_eval")
    row("rankmeter eval ≥ pytrec_eval's speed (10,000 × 100)", f"{_n(speed, '.2f')} ×",
        None if speed is None else speed >= 1.0, "bench_eval")
    for args, key in (("-q -m all_trec", "speedup_vs_trec_eval_all_trec"),
                      ("-m all_trec", "speedup_vs_trec_eval_all_trec_summary")):  # issue 23, with --trec-eval
        speed = _get(ev, key)
        row(f"rankmeter eval {args} ≥ trec_eval's speed (10,000 × 100)", f"{_n(speed, '.2f')} ×",
            None if speed is None else speed >= 1.0, "bench_eval --trec-eval")

    rep = r.get("replicas")
    for backend, b in sorted((_get(rep, "backends") or {}).items()):
        rates = _get(b, "events_per_second") or {}
        split = _get(b, "cpu_cores") or {}
        if not rates:
            continue
        one = rates.get("1")
        text = ", ".join(f"{n}: {v:,.0f} /s" + (f" ({v / one:.2f}×)" if one and n != "1" else "")
                         for n, v in sorted(rates.items()))
        top = split.get(max(rates, key=int), {})
        if top:
            text += (f"; CPU at {max(rates, key=int)}: rankmeter {top.get('rankmeter', 0):.2f}, broker "
                     f"{top.get('broker', 0):.2f}, Redis {top.get('redis', 0):.2f} cores")
        row(f"scaling 1–3 replicas ({backend.replace('_', '-')}; measured, no numeric target)", text,
            "measured" if len(rates) >= 3 else None, "bench_replicas")
    if not _get(rep, "backends"):
        row("scaling 1–3 replicas, CPU split", "—", None, "bench_replicas")

    dc = r.get("debias_cost")
    on, off = _get(dc, "pipeline_us_per_event_on"), _get(dc, "pipeline_us_per_event_off")
    row("position-bias correction's cost per event (issue 11; measured, no numeric target)",
        "—" if on is None else f"{on - off:.1f} µs/event more ({on / off:.2f}× the in-memory pipeline); "
        f"harvest {_get(dc, 'observe_us_per_query'):.0f} µs/query, estimate {_get(dc, 'estimate_ms'):.0f} ms",
        None if on is None else "measured", "bench_debias_cost")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    results = load(args.results)
    if not results:
        print(f"no results in {args.results}: run the benchmarks first (make bench)", file=sys.stderr)
        return 1
    table = rows(results)
    print("| issue-24 target | measured | | from (run at, commit) |")
    print("|---|---|---|---|")
    for target, measured, met, source in table:
        name = source.removeprefix("bench_")
        doc = results.get(name) or {}
        when = f"{doc.get('when', '')[:16]}, {doc.get('commit', '')}" if doc else ""
        print(f"| {target} | {measured} | {met} | {source} ({when}) |")
    missing = sorted({s for *_, s in table if s.removeprefix('bench_') not in results})
    if missing:
        print(f"\nnot run: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
