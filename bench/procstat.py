"""CPU time, memory and threads of process trees, from /proc (Linux): to tell which process
limits a benchmark."""

from __future__ import annotations

import os
import threading
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


Times = tuple[float, float, float, float]  # user, system; its waited-for children's user, system


def _times(pid: int) -> tuple[int, Times] | None:
    """A process's parent pid and CPU seconds (its own, and those of its children that ended
    and it waited for), None if it is gone."""
    fields = _stat(pid)
    if fields is None:
        return None
    return int(fields[1]), tuple(int(fields[i]) / TICK for i in (11, 12, 13, 14))  # type: ignore[return-value]


NONE: Times = (0.0, 0.0, 0.0, 0.0)


class TreeCpu:
    """CPU a process tree used over a window, counting the processes that end inside it.

    Reading the tree only at both ends loses a process that ends in between unless its parent
    waits for it (its CPU then moves to the parent's children time): Spark's Python daemon
    lets its workers go unwaited, and the ones that sat idle a minute end (~6 s of CPU of a
    projector's, once, which read as a negative figure). So the tree is sampled (`sample()`,
    every half second from `CpuMeter`): a process counts up to its last sample, and a parent's
    children time counts less what it took over from the children seen ending (a backend that
    lived less than a sample, say, still counts through its parent)."""

    def __init__(self, root: int, alone: bool = False) -> None:
        self.root, self.alone = root, alone
        self.first: dict[int, Times] = {}
        self.last: dict[int, tuple[int, Times]] = {}
        self.ended: dict[int, tuple[int, Times]] = {}

    def sample(self) -> None:
        pids = [self.root] if self.alone else tree(self.root)
        now = {p: t for p in pids if (t := _times(p)) is not None}
        for pid, (_, times) in now.items():
            # Born after the first sample: all its CPU is the window's.
            self.first.setdefault(pid, times if not self.last and not self.ended else NONE)
        for pid, seen in self.last.items():
            if pid not in now:
                self.ended[pid] = seen
        self.last = now

    def seconds(self) -> tuple[float, float]:
        """(user, system) CPU seconds used from the first sample to the last."""
        every = {**self.ended, **self.last}
        user = system = 0.0
        for pid, (_, (u, s, cu, cs)) in every.items():
            u0, s0, cu0, cs0 = self.first[pid]
            user += u + cu - u0 - cu0
            system += s + cs - s0 - cs0
        # A parent that waited for the children seen ending has their CPU in its children
        # time too: count it once.
        taken: dict[int, tuple[float, float]] = {}
        for parent, (u, s, cu, cs) in self.ended.values():
            tu, ts = taken.get(parent, (0.0, 0.0))
            taken[parent] = (tu + u + cu, ts + s + cs)
        for parent, (tu, ts) in taken.items():
            if parent in every:
                _, (_, _, cu, cs) = every[parent]
                _, _, cu0, cs0 = self.first[parent]
                user -= min(tu, cu - cu0)
                system -= min(ts, cs - cs0)
        return user, system


class CpuMeter:
    """CPU used by named process trees between `start()` and `stop()`, in % of one core:
    `<name>_pct` (user + system), `<name>_sys_pct` (system alone) and `<name>_jit_pct` (the
    part of it its JVMs' JIT compilers used: a JVM that still compiles is not yet the one a
    running stack has, and costs more)."""

    SAMPLE_S = 0.5

    def __init__(self, roots: dict[str, int], alone: tuple[str, ...] = ()) -> None:
        self.roots, self.alone = roots, alone  # `alone`: without their descendants
        self.trees: dict[str, TreeCpu] = {}
        self.jit0: dict[str, float] = {}
        self.t0 = 0.0
        self.machine0 = (0.0, 0.0)
        self._stopping = threading.Event()
        self._sampler: threading.Thread | None = None

    def _jit(self) -> dict[str, float]:
        return {
            name: jit_seconds([pid] if name in self.alone else tree(pid))
            for name, pid in self.roots.items()
        }

    def _sample(self) -> None:
        for t in self.trees.values():
            t.sample()

    def _sample_until_stopped(self) -> None:
        while not self._stopping.wait(self.SAMPLE_S):
            self._sample()

    def start(self) -> None:
        self.trees = {n: TreeCpu(pid, n in self.alone) for n, pid in self.roots.items()}
        self._sample()
        self.jit0, self.t0, self.machine0 = self._jit(), time.monotonic(), machine_busy()
        self._stopping.clear()
        self._sampler = threading.Thread(target=self._sample_until_stopped, daemon=True)
        self._sampler.start()

    def stop(self) -> dict[str, float]:
        assert self._sampler is not None, "start() first"
        self._stopping.set()
        self._sampler.join()
        self._sample()
        jit, wall, (busy, total) = self._jit(), time.monotonic() - self.t0, machine_busy()
        used: dict[str, float] = {}
        for name, t in self.trees.items():
            user, system = t.seconds()
            used[f"{name}_pct"] = 100 * (user + system) / wall
            used[f"{name}_sys_pct"] = 100 * system / wall
            used[f"{name}_jit_pct"] = 100 * (jit[name] - self.jit0[name]) / wall
        ours = sum(used[f"{name}_pct"] for name in self.trees)
        used["machine_busy_pct"] = 100 * (busy - self.machine0[0]) / (total - self.machine0[1])
        # Everything else on the machine, in % of one core: other work disturbs the figures.
        used["others_pct"] = 100 * (busy - self.machine0[0]) / wall - ours
        used["cores"] = round((total - self.machine0[1]) / wall)
        used["wall_s"] = wall
        return used
