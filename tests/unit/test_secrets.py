"""No known secrets: the token secret is checked for strength, never invented outside the local
stack, created atomically with mode 0600; the running stack's endpoints file is private and
ignored once its `logfold run` is gone."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import create_app
from app.auth import WeakSecret, check_secret
from config.settings import Settings
from stack import stack_env
from stack.local import load_or_create_secret, secret_for
from stack.procs import wait_until

GOOD = "q3J7x9PzK2mW8vN4tR6yB1cF5hL0dS-_aE"


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        (None, "not set"),
        ("", "not set"),
        ("short-but-random-Xq9", "needs at least 32"),
        ("change-me" * 4, "placeholder"),
        ("CHANGE_ME_CHANGE_ME_CHANGE_ME_1234", "placeholder"),
        ("your-secret-here-your-secret-here!", "placeholder"),
        ("a" * 64, "placeholder"),
    ],
)
def test_weak_secrets_are_refused_saying_what_to_do(secret: str | None, why: str) -> None:
    with pytest.raises(WeakSecret, match=why) as e:
        check_secret(secret)
    assert "openssl rand" in str(e.value)


def test_a_random_secret_of_32_bytes_is_accepted() -> None:
    assert check_secret(GOOD) == GOOD
    assert len(GOOD.encode()) >= 32


def test_the_api_refuses_to_start_with_a_placeholder_secret() -> None:
    with pytest.raises(WeakSecret):
        create_app(Settings(jwt_secret="change-me"))


def test_the_local_secret_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "data" / "jwt-secret"
    first = load_or_create_secret(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert check_secret(first) == first
    assert load_or_create_secret(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["jwt-secret"]  # no temporary left


def test_processes_creating_the_secret_at_once_all_get_the_same_one(tmp_path: Path) -> None:
    path = tmp_path / "jwt-secret"
    start = threading.Barrier(8)
    got: list[str] = []

    def create() -> None:
        start.wait()
        got.append(load_or_create_secret(path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1 and got[0] == path.read_text().strip()


def test_without_a_secret_or_a_running_stack_nothing_is_made_up(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", jwt_secret=None)
    with pytest.raises(RuntimeError, match="logfold run"):
        secret_for(settings)
    assert not (tmp_path / "data").exists()  # no new secret written anywhere


@pytest.fixture
def running_stack() -> Iterator[int]:
    """A process that looks like `logfold run` (its command line names stack.cli)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "stack.cli", "run"],
        stdin=subprocess.PIPE,
    )
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    wait_until(lambda: b"stack.cli" in cmdline.read_bytes(), 10, "the process to start")
    yield proc.pid
    proc.kill()
    proc.wait()


def stack_file(data: Path, pid: int) -> Path:
    data.mkdir(parents=True)
    path = data / stack_env.NAME
    path.write_text(
        f"{stack_env.PID}={pid}\n"
        "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092\n"
        "DATABASE_URL='postgresql://logfold:p%40ss@127.0.0.1:15432/logfold'\n"
        f"LOGFOLD_JWT_SECRET={GOOD}\n"
    )
    return path


def test_the_cli_uses_the_running_stack_unless_the_environment_says_otherwise(
    tmp_path: Path, running_stack: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL", "LOGFOLD_JWT_SECRET"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LOGFOLD_DATA_DIR", str(tmp_path / "data"))
    stack_file(tmp_path / "data", running_stack)
    settings = stack_env.settings()
    assert settings.kafka() == "127.0.0.1:19092"
    assert settings.database() == "postgresql://logfold:p%40ss@127.0.0.1:15432/logfold"
    assert secret_for(settings) == GOOD

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "elsewhere:9092")
    assert stack_env.settings().kafka() == "elsewhere:9092"
    exports = stack_env.exports(stack_env.read(Settings()) or {})
    assert "export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092\n" in exports
    assert stack_env.PID not in exports


def test_a_file_left_by_a_stack_that_died_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("KAFKA_BOOTSTRAP_SERVERS", "LOGFOLD_JWT_SECRET"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LOGFOLD_DATA_DIR", str(tmp_path / "data"))
    gone = subprocess.Popen([sys.executable, "-c", "pass", "stack.cli"])
    gone.wait()
    stack_file(tmp_path / "data", gone.pid)
    assert stack_env.read(Settings()) is None
    assert stack_env.settings().kafka_bootstrap_servers is None


def test_the_stack_file_is_private(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    path = stack_env.write(settings, {"LOGFOLD_JWT_SECRET": GOOD, "DATABASE_URL": "x y"})
    assert path.stat().st_mode & 0o777 == 0o600
    assert "DATABASE_URL='x y'" in path.read_text()
    stack_env.remove(settings)  # written by this process: removed
    assert not path.exists()
