"""The running local stack's endpoints, for the CLI in other terminals.

`logfold run` writes `<data dir>/stack.env` (mode 0600: it holds the database password and the
token secret) once everything is up, and removes it when it stops. Every other subcommand run in
the project reads it for what the environment does not set, so `logfold rebuild --all` or
`logfold token` in a second terminal talk to the stack that is running; `logfold env` prints it
as `export` lines for a shell. A file left by a `logfold run` that died is ignored (its process
is gone)."""

from __future__ import annotations

import contextlib
import os
import shlex
import tempfile
from pathlib import Path

from dotenv import dotenv_values

from config.settings import Settings

NAME = "stack.env"
PID = "LOGFOLD_STACK_PID"


def path(settings: Settings) -> Path:
    return settings.data_path / NAME


def write(settings: Settings, values: dict[str, str]) -> Path:
    """Atomically, readable by the owner only."""
    target = path(settings)
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The local stack started by `logfold run`; removed when it stops.",
        "# `logfold env` prints these as export lines for a new shell.",
        f"{PID}={os.getpid()}",
        *(f"{k}={shlex.quote(v)}" for k, v in values.items()),
    ]
    write_private(target, "\n".join(lines) + "\n")
    return target


def write_private(target: Path, text: str, replace: bool = True) -> None:
    """`text` into `target`, mode 0600 from the first byte (a private temporary file, then one
    rename), so no reader sees it half-written or readable by others. `replace=False` keeps a
    `target` that exists by then (another process was first)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, target)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def remove(settings: Settings) -> None:
    """The file, if this process wrote it."""
    file = path(settings)
    if file.is_file() and dotenv_values(file).get(PID) == str(os.getpid()):
        file.unlink(missing_ok=True)


def read(settings: Settings) -> dict[str, str] | None:
    """The running stack's values, or None when none is running here."""
    file = path(settings)
    if not file.is_file():
        return None
    values = {k: v or "" for k, v in dotenv_values(file).items()}
    if not _alive(values.get(PID, "")):
        return None
    return values


def _alive(pid: str) -> bool:
    """Whether `pid` is still a `logfold run` (not a process that reused its number)."""
    if not pid.isdigit():
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the process table
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, someone else's
            pass
        return True
    return b"logfold" in cmdline or b"stack.cli" in cmdline


def settings() -> Settings:
    """Settings from the environment, completed by the running local stack's file if any (the
    environment wins)."""
    base = Settings()
    if read(base) is None:
        return base
    return Settings(_env_file=path(base))  # type: ignore[call-arg]


def exports(values: dict[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items() if k != PID)
