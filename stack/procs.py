"""Small helpers for the local services: free ports, waiting on conditions, stopping children."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.1,
    fail_fast: bool = False,
) -> None:
    """Poll `condition` until it is true; raise TimeoutError naming `what` after `timeout` s.
    What `condition` raises means "not yet", unless `fail_fast`: then it is raised at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except Exception:  # a not-yet-ready service raises; keep polling
            if fail_fast:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def is_root() -> bool:
    return os.geteuid() == 0
