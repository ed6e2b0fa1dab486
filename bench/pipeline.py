"""The whole pipeline's capacity beside the write side alone's, measured in one run (the figures
of docs/capacity.md).

    .venv/bin/python bench/pipeline.py --rates 50 200 300 400 500 600 700 800 900 1000 1100 \\
        --duration 15 --repeats 3

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
capacity the whole pipeline keeps. A mode that sustained a rate in none of its repeats is not
run at the higher rates.

With each run: the CPU each process spent per command (ms; `machine_busy_pct` is how much of
the two cores were used), Postgres transactions and websocket messages per command, and, with
everything running, the read side by stage (`Stages`: the projector's JVM apart from its Python
process, Postgres's backends by client, the records each group of topics got).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from kafka import KafkaConsumer, TopicPartition
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.read_model import ReadModel
from bench import loadgen
from bench.live import process_env
from bench.procstat import CpuMeter, cpu_seconds, tree
from bench.read_stack import Stack, start_warmed
from config.settings import Settings, kafka_consumer_options
from config.topics import Topics
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


def socket_owners(peer_port: int) -> dict[int, int]:
    """Local port → process id of the established TCP connections to `peer_port` (from `ss`)."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    owners = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 5 or "pid=" not in line or not fields[3].endswith(f":{peer_port}"):
            continue
        local = int(fields[2].rsplit(":", 1)[1])
        owners[local] = int(line.split("pid=", 1)[1].split(",", 1)[0])
    return owners


class Stages:
    """The read side's cost by stage, beside the per-process table: the projector's JVM (Spark's
    long-lived real-time tasks: decoding each event, folding its rows, writing them to the rows
    topics; Spark's Python daemon and workers, its children, with it) and its Python process
    (reading those topics and applying each poll to Postgres);
    Postgres's backends by client (the projector's transactions, CDC's logical decoding in its
    walsender, the API's reads and the rest: background writers and short-lived backends); and
    the records each group of topics got per command (commit markers included)."""

    def __init__(self, settings: Settings, roots: dict[str, int], postgres_port: int) -> None:
        self.settings, self.roots, self.postgres_port = settings, roots, postgres_port
        self.topics = Topics(settings.topic_prefix)
        self.offsets = KafkaConsumer(
            bootstrap_servers=settings.kafka(), metrics_enabled=False, **kafka_consumer_options()
        )
        self.cpu0: dict[str, tuple[float, float]] = {}
        self.ends0: dict[str, int] = {}

    def _projector(self) -> CpuMeter:
        """The projector's two stages, each sampled as a tree (`TreeCpu`): its JVM with its
        descendants (Spark's Python daemon lets its idle workers end unwaited, and read only at
        both ends of a run their CPU went missing: a figure below zero), and its Python process
        alone."""
        root = self.roots["projector"]
        jvm = next(p for p in tree(root) if p != root and "java" in _exe(p))
        return CpuMeter(
            {"projector_jvm": jvm, "projector_python": root}, alone=("projector_python",)
        )

    def _backends(self) -> dict[str, list[int]]:
        """Postgres backends by the process tree of their client (CDC's walsender by its type)."""
        owners = socket_owners(self.postgres_port)
        trees = {name: set(tree(pid)) for name, pid in self.roots.items()}
        by: dict[str, list[int]] = {}
        with psycopg.connect(self.settings.database()) as conn:
            rows = conn.execute(
                "SELECT pid, backend_type, client_port FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid()"
            ).fetchall()
        for pid, kind, port in rows:
            client = owners.get(port) if port else None
            name = "cdc" if kind == "walsender" else "other"
            name = next((n for n, t in trees.items() if client in t), name)
            by.setdefault(f"postgres_for_{name}", []).append(pid)
        return by

    def _ends(self) -> dict[str, int]:
        prefix = self.topics.prefix
        named = [t for t in self.offsets.topics() if t.startswith(prefix)]
        tps = [
            TopicPartition(t, p) for t in named for p in self.offsets.partitions_for_topic(t) or ()
        ]
        ends: dict[str, int] = {}
        for tp, end in self.offsets.end_offsets(tps).items():
            group = tp.topic.removeprefix(prefix).split(".", 1)[0]  # events, cdc, join-rows, …
            ends[group] = ends.get(group, 0) + int(end)
        return ends

    def start(self) -> None:
        self.meter = self._projector()
        self.meter.start()
        self.pids = self._backends()
        self.cpu0 = {name: cpu_seconds(pids) for name, pids in self.pids.items()}
        self.ends0 = self._ends()

    def stop(self, done: int) -> dict[str, Any]:
        used = self.meter.stop()
        cpu = {
            name: round(used[f"{name}_pct"] / 100 * used["wall_s"] * 1e3 / done, 3)
            for name in self.meter.roots
        }
        for name, pids in self.pids.items():
            (u, s), (u0, s0) = cpu_seconds(pids), self.cpu0[name]
            cpu[name] = round((u + s - u0 - s0) * 1e3 / done, 3)
        ends = self._ends()
        records = {g: round((n - self.ends0.get(g, 0)) / done, 2) for g, n in ends.items()}
        return {"cpu_ms_per_command": cpu, "offsets_per_command": records}

    def close(self) -> None:
        self.offsets.close()


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


class Pipeline:
    def __init__(self, stack: Stack, procs: Processes, api: HttpApi, meter: CpuMeter) -> None:
        self.stack, self.procs, self.api, self.meter = stack, procs, api, meter
        self.settings = procs.settings
        names = {p.pid: " ".join(map(str, p.args)) for p in procs.procs}
        self.paused = [pid for pid, args in names.items() if args.endswith(("projector", "cdc"))]
        self.stages = Stages(self.settings, dict(meter.roots), stack.pg.port)
        self.customers = [
            api.command(
                "register-customer", {"name": f"c{i}", "email": f"c{i}@bench.example"}
            ).body["aggregate_id"]
            for i in tqdm(range(CUSTOMERS), desc="creating customers", unit="cmd")
        ]
        url = api.base_url.replace("http://", "ws://") + "/ws"
        self.subscriber = WsClient(url, token("views:read"))
        self.subscriber.subscribe("all", "customers")

    def renice(self, nice: int) -> int:
        """Every thread of the projector's and CDC's trees at niceness `nice` (the bench's
        processes share one scheduling group, so a thread's own niceness is what counts)."""
        n = 0
        for root in self.paused:
            for pid in tree(root):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
                        n += 1
                    except OSError:
                        pass
        return n

    def quiet(self, for_s: float, within_s: float) -> bool:
        """Whether the subscriber gets no message for `for_s` seconds, within `within_s`: the
        pushes of a backlog are over (a paused run's backlog pushes fewer changes than it had
        commands, likely its renames of one customer folded together, so no count is the end)."""
        started = last = time.monotonic()
        seen = len(self.subscriber.messages)
        while time.monotonic() - started < within_s:
            time.sleep(0.1)  # a benchmark's pacing, not a test's wait
            now, count = time.monotonic(), len(self.subscriber.messages)
            if count != seen:
                seen, last = count, now
            elif now - last >= for_s:
                return True
        return False

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
            if mode == "full":
                self.stages.start()
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
                # The folds' lag is not the whole read side: CDC's backlog and the hub's pushes
                # of it would otherwise fall into the next run.
                if not self.quiet(QUIET_S, 600):
                    raise RuntimeError("the subscriber was still getting a paused run's changes")
        done = max(result.statuses.get(201, 0), 1)
        # Once the views have caught up: every stage's work for the run's commands.
        stages = self.stages.stop(done) if mode == "full" else None
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
            "read_side_stages": stages,
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
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[50, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100],
        help="commands/s offered, in turn (a mode stops above a rate it sustained in no repeat)",
    )
    parser.add_argument("--duration", type=float, default=15, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per rate and mode")
    parser.add_argument("--warmup", type=float, default=45, help="seconds of load first")
    parser.add_argument("--p99-ms", type=float, default=1000, help="sustained: p99 at most this")
    parser.add_argument(
        "--keep-up-s", type=float, default=5, help="sustained (full): views caught up within this"
    )
    parser.add_argument(
        "--read-side-nice",
        type=int,
        default=0,
        help="run the projector's and CDC's threads at this niceness (0: as `make run` does)",
    )
    args = parser.parse_args()

    stack = Stack()
    with stack as settings:
        procs = Processes(settings, stack.work, process_env(settings, {}))
        try:
            api, meter = start_warmed(stack, procs)
            pipeline = Pipeline(stack, procs, api, meter)
            if args.read_side_nice:
                n = pipeline.renice(args.read_side_nice)
                print(f"{n} read-side threads at niceness {args.read_side_nice}", file=sys.stderr)
            for _ in tqdm(range(1), desc=f"warming up ({args.warmup:.0f} s)"):
                pipeline.run("full", max(args.rates) / 2, args.warmup, 60)
            runs: list[dict[str, Any]] = []
            todo = [(r, m) for r in args.rates for _ in range(args.repeats) for m in MODES]
            beyond: set[str] = set()  # modes that sustained a rate in none of its repeats
            for rate, mode in tqdm(todo, desc="runs", unit="run"):
                if mode in beyond:  # a higher rate would fail too: not run, not sustained
                    continue
                runs.append(pipeline.run(mode, rate, args.duration, args.keep_up_s))
                runs[-1]["sustained"] = sustained(runs[-1], args.p99_ms, args.keep_up_s)
                these = [r for r in runs if (r["mode"], r["offered_per_s"]) == (mode, rate)]
                if len(these) == args.repeats and not any(r["sustained"] for r in these):
                    beyond.add(mode)
            pipeline.stages.close()
        finally:
            procs.stop()
    print(json.dumps(summary(runs, args), indent=2))


MODES = ("full", "write")
QUIET_S = 2  # a rate of 500/s or more pushes a change every few milliseconds while it lasts


def summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per mode: the highest rate sustained in most of its repeats; per rate and mode, the
    medians; and the full pipeline's share of the write side's capacity."""
    levels: dict[str, dict[float, dict[str, Any]]] = {m: {} for m in MODES}
    for mode in MODES:
        for rate in args.rates:
            these = [r for r in runs if r["mode"] == mode and r["offered_per_s"] == rate]
            if not these:  # beyond a rate the mode sustained in none of its repeats
                continue
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
            staged = [r["read_side_stages"] for r in these if r.get("read_side_stages")]
            if staged:
                levels[mode][rate]["read_side_stages"] = {
                    part: {
                        k: round(statistics.median(st[part].get(k, 0) for st in staged), 2)
                        for k in set().union(*(st[part] for st in staged))
                    }
                    for part in ("cpu_ms_per_command", "offsets_per_command")
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
