"""The whole pipeline's capacity beside the write side alone's, measured in one run (the figures
of docs/capacity.md).

    .venv/bin/python bench/pipeline.py --rates 50 100 150 200 250 300 --duration 20 --repeats 3

One stack as `make run` starts it on one machine: a broker, Postgres, a command processor, an
API process, the Spark projector (every projection and join, in real-time mode), CDC, and a
websocket client subscribed to `customers` (so the API's hub pushes every change). The load is
`rename-customer` over 200 customers, open-loop (bench/loadgen.py).

Each rate runs in two modes, one after the other, `--repeats` times:

- `full`: everything running;
- `write`: the projector and CDC paused (SIGSTOP: the write side has the machine to itself),
  and, once the run is over, resumed and caught up before the next one starts.

A rate is *sustained* when at least 99 % of its commands got a `201` with a p99 under
`--p99-ms`, and, in `full`, when the views had applied every command within `--keep-up-s` of
the last one's `201` (the read side kept up). The highest sustained rate of each mode is the
median over the repeats, and the ratio of the two is the figure: how much of the write side's
capacity the whole pipeline keeps.

With each run: the CPU each process spent per command (ms; `machine_busy_pct` is how much of
the two cores were used), and the read side's work per event where it can be counted (Postgres
transactions per command, the rows topic's records).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.read_model import ReadModel
from bench import loadgen
from bench.live import process_env
from bench.procstat import CpuMeter, tree
from bench.read_stack import Stack, start_warmed
from config.settings import Settings
from tests.support import HttpApi, Processes, token
from tests.wsclient import WsClient

CUSTOMERS = 200


def lag(settings: Settings) -> int:
    """Records not yet applied, over every fold (projection and join)."""
    model = ReadModel(settings)
    try:
        return sum(int(v["events"]) for v in model.lag().values())
    finally:
        model.engine.dispose()


def caught_up_within(settings: Settings, seconds: float) -> float | None:
    """Seconds until every fold has applied the whole log, or None past `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if lag(settings) == 0:
            return time.monotonic() - started
        time.sleep(0.1)  # polling a database counter: a benchmark's pacing, not a test's wait
    return None


def xact_commits(settings: Settings) -> int:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


class Pipeline:
    def __init__(self, stack: Stack, procs: Processes, api: HttpApi, meter: CpuMeter) -> None:
        self.stack, self.procs, self.api, self.meter = stack, procs, api, meter
        self.settings = procs.settings
        names = {p.pid: " ".join(map(str, p.args)) for p in procs.procs}
        self.paused = [pid for pid, args in names.items() if args.endswith(("projector", "cdc"))]
        self.customers = [
            api.command(
                "register-customer", {"name": f"c{i}", "email": f"c{i}@bench.example"}
            ).body["aggregate_id"]
            for i in tqdm(range(CUSTOMERS), desc="creating customers", unit="cmd")
        ]
        url = api.base_url.replace("http://", "ws://") + "/ws"
        self.subscriber = WsClient(url, token("views:read"))
        self.subscriber.subscribe("all", "customers")

    def _signal(self, sig: signal.Signals) -> None:
        for root in self.paused:
            for pid in tree(root):
                os.kill(pid, sig)

    def run(self, mode: str, rate: float, duration: float, keep_up_s: float) -> dict[str, Any]:
        if mode == "write":
            self._signal(signal.SIGSTOP)
        try:
            commits = xact_commits(self.settings)
            pushed = len(self.subscriber.messages)
            self.meter.start()
            result = loadgen.offered_load(
                [self.api.base_url], token(), loadgen.renames(self.customers), rate, duration, 64
            )
            cpu = self.meter.stop()
            kept_up = caught_up_within(self.settings, keep_up_s) if mode == "full" else None
            commits = xact_commits(self.settings) - commits
            pushed = len(self.subscriber.messages) - pushed
        finally:
            if mode == "write":
                self._signal(signal.SIGCONT)
                if caught_up_within(self.settings, 600) is None:
                    raise RuntimeError("the read side did not catch up after a paused run")
        done = max(result.statuses.get(201, 0), 1)
        ms = {
            name.removesuffix("_pct"): round(v / 100 * cpu["wall_s"] * 1e3 / done, 3)
            for name, v in cpu.items()
            if name.endswith("_pct") and not name.endswith(("_sys_pct", "_jit_pct", "busy_pct"))
        }
        ms["total"] = round(sum(v for k, v in ms.items() if k != "others"), 3)
        return {
            "mode": mode,
            "offered_per_s": rate,
            **{k: v for k, v in result.summary().items() if k != "offered"},
            "caught_up_s": kept_up,
            "cpu_ms_per_command": ms,
            "machine_busy_pct": round(cpu["machine_busy_pct"], 1),
            "jit_pct": round(sum(v for k, v in cpu.items() if k.endswith("_jit_pct")), 1),
            "postgres_commits_per_command": round(commits / done, 2),
            "messages_pushed_per_command": round(pushed / done, 2),
        }


def sustained(run: dict[str, Any], p99_ms: float, keep_up_s: float) -> bool:
    statuses = run["statuses"]
    ok = statuses.get(201, 0) >= 0.99 * sum(statuses.values()) and run["p99_ms"] <= p99_ms
    if run["mode"] == "full":
        ok = ok and run["caught_up_s"] is not None and run["caught_up_s"] <= keep_up_s
    return bool(ok)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 100, 150, 200, 250, 300])
    parser.add_argument("--duration", type=float, default=20, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per rate and mode")
    parser.add_argument("--warmup", type=float, default=60, help="seconds of load first")
    parser.add_argument("--p99-ms", type=float, default=1000, help="sustained: p99 at most this")
    parser.add_argument(
        "--keep-up-s", type=float, default=5, help="sustained (full): views caught up within this"
    )
    args = parser.parse_args()

    stack = Stack()
    with stack as settings:
        procs = Processes(settings, stack.work, process_env(settings, {}))
        try:
            api, meter = start_warmed(stack, procs)
            pipeline = Pipeline(stack, procs, api, meter)
            for _ in tqdm(range(1), desc=f"warming up ({args.warmup:.0f} s)"):
                pipeline.run("full", max(args.rates) / 2, args.warmup, 60)
            runs: list[dict[str, Any]] = []
            todo = [(r, m) for r in args.rates for _ in range(args.repeats) for m in MODES]
            for rate, mode in tqdm(todo, desc="runs", unit="run"):
                runs.append(pipeline.run(mode, rate, args.duration, args.keep_up_s))
                runs[-1]["sustained"] = sustained(runs[-1], args.p99_ms, args.keep_up_s)
        finally:
            procs.stop()
    print(json.dumps(summary(runs, args), indent=2))


MODES = ("full", "write")


def summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per mode: the highest rate sustained in most of its repeats; per rate and mode, the
    medians; and the full pipeline's share of the write side's capacity."""
    levels: dict[str, dict[float, dict[str, Any]]] = {m: {} for m in MODES}
    for mode in MODES:
        for rate in args.rates:
            these = [r for r in runs if r["mode"] == mode and r["offered_per_s"] == rate]
            cpu_keys = these[0]["cpu_ms_per_command"]
            levels[mode][rate] = {
                "sustained": sum(r["sustained"] for r in these) > len(these) / 2,
                "completed_per_s": statistics.median(r["completed_per_s"] for r in these),
                "p50_ms": statistics.median(r["p50_ms"] for r in these),
                "p99_ms": statistics.median(r["p99_ms"] for r in these),
                "cpu_ms_per_command": {
                    k: round(statistics.median(r["cpu_ms_per_command"][k] for r in these), 2)
                    for k in cpu_keys
                },
                "machine_busy_pct": statistics.median(r["machine_busy_pct"] for r in these),
            }
    best = {
        m: max((rate for rate, lv in levels[m].items() if lv["sustained"]), default=0.0)
        for m in MODES
    }
    return {
        "benchmark": "pipeline",
        "topology": "one machine: a broker, Postgres, 1 processor, 1 API process, the Spark "
        "projector (local), CDC, one websocket subscriber",
        "highest_sustained_per_s": best,
        "full_over_write": round(best["full"] / best["write"], 2) if best["write"] else None,
        "levels": {m: {str(k): v for k, v in lv.items()} for m, lv in levels.items()},
        "runs": runs,
        "args": vars(args),
    }


if __name__ == "__main__":
    main()
