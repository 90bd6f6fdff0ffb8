"""What the log costs per finished request, no network.

Run: ``.venv/bin/python tests/bench/bench_log.py [--n 20000] [--repeat 5]``. Prints figures
only: microseconds per ``RequestFinished`` published on a bus with the event log subscribed
(``proxy.observe.log.EventLog``), lines written to /dev/null, best of ``--repeat`` runs of
``--n``; for text and JSON lines, with the access log off (the default: the per-request
events are not even subscribed) and on; and Python's ``logging`` alone writing one such line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxy.config import LogConfig
from proxy.events import EventBus, RequestFinished
from proxy.observe.log import EventLog, configure

EVENT = RequestFinished(
    "chat", "emulator-model", True, True, 200, "ok", 0.0123, 0.001, "3f2a9c1e8b7d4a6f9e0c1b2a"
)


def per_call_us(fn: object, n: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with open(os.devnull, "w") as devnull:
        for fmt in ("text", "json"):
            for access in (False, True):
                config = LogConfig(format=fmt, access_log=access)
                configure(config, stream=devnull)
                bus = EventBus()
                EventLog(config, "http://127.0.0.1:8000").subscribe(bus)
                us = per_call_us(lambda b=bus: b.publish(EVENT), args.n, args.repeat)
                print(f"{fmt:4} access_log={access!s:5}: {us:6.2f} us per finished request")
        configure(LogConfig(), stream=devnull)
        plain = logging.getLogger("bench")
        us = per_call_us(lambda: plain.info("chat emulator-model 200 ok"), args.n, args.repeat)
        print(f"logging alone, one text line: {us:6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
