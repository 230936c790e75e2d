"""The cycle collector's pauses in the pipeline alone (bench_serve.pipeline_alone: no Kafka,
no Redis), with serve's tuning (`rankmeter.gc_tuning`, frozen survivors) or with the
thresholds alone (`--no-freeze`, as before issue 24's freshness work), and the reference
cycles that freezing would leak (`gc.unfreeze(); gc.collect()` at the end):

    PYTHONPATH=service .venv/bin/python bench/gc_pauses.py [--events 1000000] [--no-freeze]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402
from rankmeter import gc_tuning  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--no-freeze", action="store_true", help="the thresholds only, nothing frozen")
    args = parser.parse_args()
    if args.no_freeze:
        gc_tuning._freeze_survivors = lambda phase, info: None  # (what tune() registers)
    pauses: dict[int, list[float]] = defaultdict(list)
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - began[0])

    gc.collect()  # (what importing left behind is not the pipeline's)
    gc.callbacks.append(timed)
    rate, cpu_us = bench_serve.pipeline_alone(args.events)
    gc.callbacks.remove(timed)
    gc_tuning.untune()
    print(f"pipeline alone: {rate:,.0f} events/s, {cpu_us:.2f} µs/event ({'thresholds only' if args.no_freeze else 'frozen survivors'})")
    for generation, times in sorted(pauses.items()):
        times.sort()
        print(f"generation {generation}: {len(times)} collections, longest {times[-1] * 1000:.1f} ms, "
              f"median {times[len(times) // 2] * 1000:.1f} ms, total {sum(times) * 1000:.0f} ms")
    gc.unfreeze()
    print(f"unreachable once thawed (cycles freezing would leak): {gc.collect()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
