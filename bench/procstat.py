"""CPU time, memory and threads of process trees, from /proc (Linux): to tell which process
limits a benchmark."""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int, task: str = "") -> list[str] | None:
    """The fields of /proc/<pid>/stat (or of one thread's: `task`), from the 3rd (state) on."""
    try:
        text = Path(f"/proc/{pid}/{task}stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def tree(pid: int) -> list[int]:
    """The process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, ()))
    return found


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU time the processes, and their children that ended (Postgres
    backends, say), have used so far."""
    user = system = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            user += int(fields[11]) + int(fields[13])  # utime, cutime
            system += int(fields[12]) + int(fields[14])  # stime, cstime
    return user / TICK, system / TICK


def jit_seconds(pids: list[int]) -> float:
    """CPU time the JIT compiler threads of the processes (the JVMs among them: HotSpot's
    `C1 CompilerThread<n>` and `C2 CompilerThread<n>`) have used so far."""
    used = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                if "CompilerThre" not in Path(f"/proc/{pid}/task/{tid}/comm").read_text():
                    continue
            except OSError:
                continue
            fields = _stat(pid, f"task/{tid}/")
            if fields is not None:
                used += int(fields[11]) + int(fields[12])  # utime, stime
    return used / TICK


def status(pid: int, field: str) -> int:
    """A numeric field of /proc/<pid>/status (`VmRSS` in kB, `Threads`), 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib(pids: list[int]) -> float:
    return sum(status(p, "VmRSS") for p in pids) / 1024


def threads(pids: list[int]) -> int:
    return sum(status(p, "Threads") for p in pids)


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / TICK, sum(fields) / TICK


class CpuMeter:
    """CPU used by named process trees between `start()` and `stop()`, in % of one core:
    `<name>_pct` (user + system), `<name>_sys_pct` (system alone) and `<name>_jit_pct` (the
    part of it its JVMs' JIT compilers used: a JVM that still compiles is not yet the one a
    running stack has, and costs more)."""

    def __init__(self, roots: dict[str, int], alone: tuple[str, ...] = ()) -> None:
        self.roots, self.alone = roots, alone  # `alone`: without their descendants
        self.begin: dict[str, tuple[float, float, float]] = {}
        self.t0 = 0.0
        self.machine0 = (0.0, 0.0)

    def _now(self) -> dict[str, tuple[float, float, float]]:
        """Per name: (user, system, JIT compilers') CPU seconds so far."""
        now = {}
        for name, pid in self.roots.items():
            pids = [pid] if name in self.alone else tree(pid)
            now[name] = (*cpu_seconds(pids), jit_seconds(pids))
        return now

    def start(self) -> None:
        self.begin, self.t0, self.machine0 = self._now(), time.monotonic(), machine_busy()

    def stop(self) -> dict[str, float]:
        end, wall, (busy, total) = self._now(), time.monotonic() - self.t0, machine_busy()
        used: dict[str, float] = {}
        for name, (user, system, jit) in end.items():
            user0, system0, jit0 = self.begin[name]
            used[f"{name}_pct"] = 100 * (user + system - user0 - system0) / wall
            used[f"{name}_sys_pct"] = 100 * (system - system0) / wall
            used[f"{name}_jit_pct"] = 100 * (jit - jit0) / wall
        ours = sum(used[f"{name}_pct"] for name in end)
        used["machine_busy_pct"] = 100 * (busy - self.machine0[0]) / (total - self.machine0[1])
        # Everything else on the machine, in % of one core: other work disturbs the figures.
        used["others_pct"] = 100 * (busy - self.machine0[0]) / wall - ours
        used["cores"] = round((total - self.machine0[1]) / wall)
        used["wall_s"] = wall
        return used
