"""idle: CPU of the whole stack left alone (see bench/read_side.py)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procstat import CpuMeter
from bench.read_stack import Stack, extra
from commands.messages import LogPosition
from config.settings import Settings
from stack.procs import wait_until
from tests.support import HttpApi, Processes, token


def idle(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    with stack as settings:
        procs = Processes(settings, stack.work, extra(args))
        try:
            procs.cdc()
            procs.processor()
            procs.projector()
            _, url = procs.api()
            procs.wait_processing(url, 1)
            api = HttpApi(url, token())
            first = api.command("register-customer", {"name": "warm", "email": "w@example.com"})
            wait_until(lambda: included(settings, first.body["position"]), 180, "the projector")
            names = ["cdc", "processor", "projector", "api"]
            roots = dict(zip(names, (p.pid for p in procs.procs), strict=True))
            roots.update(stack.infrastructure())
            meter = CpuMeter(roots)

            def window(seconds: float, desc: str) -> dict[str, float]:
                meter.start()
                for _ in tqdm(range(round(seconds)), desc=desc, unit="s", leave=False):
                    time.sleep(1)
                cpu = meter.stop()
                run = {n: cpu[f"{n}_pct"] for n in roots}
                return {
                    "all": sum(run.values()),
                    **run,
                    "jit": sum(cpu[f"{n}_jit_pct"] for n in roots),
                    "others": cpu["others_pct"],
                }

            # Left alone first: the JVMs, the broker's above all, go on compiling what the
            # start-up ran for minutes (C2); measured, not counted, until they are quiet.
            settling = [window(args.settle, "settling")]
            while settling[-1]["jit"] >= args.settle_jit_pct and (
                len(settling) * args.settle < args.max_settle
            ):
                settling.append(window(args.settle, "settling (JIT)"))
            runs = [
                window(args.duration, f"idle {i + 1}/{args.repeats}") for i in range(args.repeats)
            ]
            return {
                "benchmark": "idle",
                "percent_of_one_core": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
                "runs": runs,
                "settling": settling,
            }
        finally:
            procs.stop()


def included(settings: Settings, token_: str) -> bool:
    p = LogPosition.parse(token_)
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT offsets ->> %s FROM projection_progress WHERE projection = 'customers'",
            (f"{p.topic}:{p.partition}",),
        ).fetchone()
    return bool(row and row[0] is not None and int(row[0]) >= p.offset)
