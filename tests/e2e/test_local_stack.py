"""The README's path, end to end: `logfold run` on local defaults, the README's curl examples,
Ctrl-C, a restart that keeps the data, and `logfold reset`."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from config.settings import Settings
from stack.procs import port_open, wait_until
from tests.support import REPO, log_of

pytestmark = pytest.mark.e2e


def free_port_pair(count: int = 2) -> int:
    """A port p with the `count - 1` after it free too (the local broker's controller listens
    on p + 1; the cluster's brokers on p, p + 2, p + 4, its API nodes after the API's port).

    Below the kernel's ephemeral range: these ports are bound only once the stack has started
    its other parts, and a port the kernel hands out meanwhile (another part's `bind(0)`, a
    client connection's own end) would take one of them."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, low - count)
        if all(bindable(port + i) for i in range(count)):
            return port
    raise RuntimeError(f"no {count} free ports in a row")


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def as_a_background_job() -> None:
    """Start `run` as a non-interactive shell starts a command with `&` (a script, CI): with
    SIGINT and SIGQUIT ignored. Ctrl-C (SIGINT) must stop it all the same."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


class RunningStack:
    def __init__(self, data_dir: Path, *args: str) -> None:
        self.args = args  # `logfold run`'s own (`--cluster`)
        self.data_dir = data_dir
        cluster = "--cluster" in args
        self.kafka_port = free_port_pair(6 if cluster else 2)
        self.pg_port = free_port_pair(1)
        self.api_port = free_port_pair(3 if cluster else 1)
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("LOGFOLD_") and k not in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL")
        }
        self.env.update(
            {
                "LOGFOLD_HOME": str(REPO / ".stack"),
                "LOGFOLD_DATA_DIR": str(data_dir),
                "LOGFOLD_KAFKA_PORT": str(self.kafka_port),
                "LOGFOLD_POSTGRES_PORT": str(self.pg_port),
                "LOGFOLD_API_PORT": str(self.api_port),
            }
        )
        self.base = f"http://127.0.0.1:{self.api_port}"
        self.output: list[str] = []
        self.interrupted_at = 0  # how many lines it had printed when it was interrupted
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 180) -> str:
        self.spawn()
        try:
            wait_until(
                self._printed_token, timeout, "`logfold run` to print its token", fail_fast=True
            )
        except (TimeoutError, AssertionError) as e:
            raise AssertionError(f"{e}; its last lines:\n{self.tail()}") from e
        line = next(line for line in self.output if "export TOKEN=" in line)
        return line.split("export TOKEN=", 1)[1].strip()

    def spawn(self) -> None:
        """`logfold run` started, not waited for."""
        self.output = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", "run", *self.args],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=as_a_background_job,
            process_group=0,  # as a terminal's foreground job, which Ctrl-C signals as a whole
        )
        self._collector = threading.Thread(target=self._collect, daemon=True)
        self._collector.start()

    def _printed_token(self) -> bool:
        if any("export TOKEN=" in line for line in self.output):
            return True
        assert self.proc is not None
        code = self.proc.poll()  # a stack that stopped before it was up never prints it
        assert code is None, f"`logfold run` exited with {code} before it was up"
        return False

    def tail(self, lines: int = 40) -> str:
        """The last lines `logfold run` printed (its processes' warnings and errors), for a
        failing assertion to show."""
        return "".join(self.output[-lines:])

    def _collect(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the whole process group, as a terminal sends it."""
        assert self.proc is not None
        self.interrupted_at = len(self.output)
        os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(timeout=90)
        self._collector.join(10)  # until the pipe's end: every line it printed
        return code

    def kill(self) -> None:
        """Stop the stack whatever state a failed test left it in: SIGTERM first, which stops
        its processes, Kafka and Postgres (a SIGKILL of `run` alone would leave them running
        for the rest of the session), then SIGKILL if it does not stop in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A stack's data directory outside pytest's own temporary folder: Postgres runs as another
    user and must reach it, and that folder is private (0700), made so again by every pytest
    session that starts on the machine meanwhile."""
    top = Path(tempfile.mkdtemp(prefix="logfold-e2e-"))
    top.chmod(0o755)
    yield top / "data"
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def stack(data_dir: Path) -> Iterator[RunningStack]:
    running = RunningStack(data_dir)
    yield running
    running.kill()


def readme_curl_block() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    return next(b for b in blocks if "curl" in b and "register-customer" in b)


def test_readme_flow_restart_keeps_data_and_reset_wipes_it(
    stack: RunningStack, data_dir: Path
) -> None:
    token = stack.start()
    script = readme_curl_block().replace("http://127.0.0.1:8000", stack.base)
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env={**os.environ, "TOKEN": token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = f"{out.stdout}\n{out.stderr}\n--- logfold run:\n{stack.tail()}"
    assert out.returncode == 0, said
    assert '"type":"CustomerRegistered"' in out.stdout, said
    assert '"book_id":"dune"' in out.stdout and '"price_cents":2499' in out.stdout, said
    assert '"status":"up"' in out.stdout, said

    second_terminal(stack, data_dir)
    cdc_is_started_again_after_kill_9(stack, token)

    assert stack.interrupt() == 0, stack.tail()
    a_terminal_a_person_can_read(stack)
    assert not port_open(stack.kafka_port) and not port_open(stack.pg_port)
    assert not port_open(stack.api_port)
    assert not (data_dir / "stack.env").exists()  # gone with the stack
    assert cli(stack.env, "env").returncode == 1

    # Started again for what it kept, not for its projector's first seconds: no warm-up, no
    # rebuild rehearsal.
    stack.env["LOGFOLD_PROJECTOR_WARM_UP_ROUNDS"] = "0"
    stack.env["LOGFOLD_PROJECTOR_REBUILD_REHEARSAL_RECORDS"] = "0"
    token = stack.start()
    r = requests.post(
        f"{stack.base}/commands/reprice-book",
        timeout=30,
        headers={"Authorization": f"Bearer {token}"},
        json={"aggregate_id": "dune", "expected_version": 2, "data": {"price_cents": 999}},
    )
    assert r.status_code == 201 and r.json()["version"] == 3, r.text
    assert stack.interrupt() == 0

    reset = subprocess.run(
        [sys.executable, "-m", "stack.cli", "reset", "--yes"],
        cwd=REPO,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reset.returncode == 0, reset.stderr
    assert not data_dir.exists()


def test_ctrl_c_while_the_stack_starts_stops_what_had_started(
    stack: RunningStack, data_dir: Path
) -> None:
    """Ctrl-C before the banner, while the processes are being started (Kafka and Postgres up,
    the first of them talking, the API and the projector still starting): whatever had started
    stops, with a line each and no traceback, and nothing is left behind: no port open, no
    `stack.env`, no process of the stack."""
    stack.spawn()
    wait_until(
        lambda: any(re.match(r"(webhooks|processor|cdc) +\| ", line) for line in stack.output),
        120,
        "the first of `logfold run`'s processes to log",
    )
    assert stack.interrupt() == 0, stack.tail()
    said = "".join(stack.output[stack.interrupted_at :])
    assert "Traceback" not in said and "\tat " not in said, said
    assert "stopped Postgres" in said and "stopped Kafka" in said, said
    # Each process stopped when asked, even one that had not yet set up its own handler.
    assert "while stopping" not in said and "killed" not in said, said
    assert not any(port_open(p) for p in (stack.kafka_port, stack.pg_port, stack.api_port))
    assert not (data_dir / "stack.env").exists()
    assert processes_naming(str(data_dir)) == []


def processes_naming(text: str) -> list[str]:
    """The command lines of the machine's processes that hold `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if text in line:
            found.append(line)
    return found


PREFIXED = re.compile(r"^(run|processor|projector|cdc|webhooks|api) +\| ")


def a_terminal_a_person_can_read(stack: RunningStack) -> None:
    """What `logfold run` printed at the default log level: no Spark warnings, every line but
    the banner's prefixed with its process, and after Ctrl-C a line for each thing it stopped
    (no Python traceback, no Java stack)."""
    output = stack.output
    everything = "".join(output)
    assert [line for line in output if re.search(r"\bWARN\b", line)] == [], everything
    first = next(i for i, line in enumerate(output) if "Logfold is running." in line)
    last = next(i for i, line in enumerate(output) if line.startswith("Ctrl-C stops everything"))
    logged = [line for line in output[:first] + output[last + 1 :] if line.strip()]
    assert [line for line in logged if not PREFIXED.match(line)] == [], everything
    stopping = output[stack.interrupted_at :]
    said = "".join(stopping)
    assert len(stopping) <= 10, said
    assert "Traceback" not in said and "\tat " not in said, said
    for what in ("api", "webhooks", "cdc", "projector", "processor", "Postgres", "Kafka"):
        assert f"stopped {what}" in said, said
    # The API first (it finishes what it answers while what feeds it still runs), the engines last.
    order = [ln.split("stopped ", 1)[1].split()[0] for ln in stopping if "stopped " in ln]
    assert order[0] == "api" and set(order[-2:]) == {"Postgres", "Kafka"}, said


def cli(
    env: dict[str, str], *args: str, cwd: Path = REPO, shell: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`logfold …` (or a bash line using `logfold`) as a user would type it in a terminal."""
    command = ["bash", "-euo", "pipefail", "-c", shell] if shell else ["logfold", *args]
    path = f"{Path(sys.executable).parent}:{env.get('PATH', os.environ['PATH'])}"
    return subprocess.run(
        command,
        cwd=cwd,
        env={**env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )


def cdc_is_started_again_after_kill_9(stack: RunningStack, token: str) -> None:
    """`kill -9` of the CDC process: `logfold run` starts it again, says so, and view changes
    go on reaching the change feeds (which CDC's changelogs feed)."""
    assert stack.proc is not None
    cdc = _child(stack.proc.pid, "stack.cli cdc")
    assert cdc > 0, "no CDC process under `logfold run`"
    os.kill(cdc, signal.SIGKILL)
    wait_until(
        lambda: any("cdc exited with -9; starting it again" in line for line in stack.output),
        30,
        "the restart's line",
    )
    run = stack.proc.pid
    wait_until(lambda: _child(run, "stack.cli cdc") not in (0, cdc), 30, "a new CDC process")
    auth = {"Authorization": f"Bearer {token}"}
    name = f"after-{uuid.uuid4().hex[:6]}"
    feed = f"{stack.base}/views/customers/changes"
    start = requests.get(feed, params={"name": name}, headers=auth, timeout=30).json()["next"]
    posted = requests.post(
        f"{stack.base}/commands/register-customer",
        json={"data": {"name": name, "email": "after@example.com"}},
        headers=auth,
        timeout=30,
    )
    assert posted.status_code == 201, posted.text
    page = requests.get(
        feed, params={"name": name, "since": start, "wait": 30}, headers=auth, timeout=60
    ).json()
    assert [c["row"]["name"] for c in page["changes"]] == [name], page


def _child(parent: int, command: str) -> int:
    """The pid of `parent`'s child whose command line holds `command` (0: none)."""
    for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if command in cmdline:
            return int(pid)
    return 0


def second_terminal(stack: RunningStack, data_dir: Path) -> None:
    """Another shell in the project while `logfold run` runs: no endpoint or secret is set, and
    the CLI finds the running stack by itself."""
    assert (data_dir / "stack.env").stat().st_mode & 0o777 == 0o600
    assert "LOGFOLD_JWT_SECRET" not in stack.env and "DATABASE_URL" not in stack.env

    printed = cli(stack.env, "token", "--scope", "views:read")
    assert printed.returncode == 0, printed.stderr
    r = requests.get(
        f"{stack.base}/views/customers",
        headers={"Authorization": f"Bearer {printed.stdout.strip()}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text  # signed with the running stack's secret

    # A token for one customer's browser: only that customer's rows, no view without them.
    own = cli(stack.env, "token", "--scope", "views:read", "--rows", "customer_id=nobody")
    assert own.returncode == 0, own.stderr
    auth = {"Authorization": f"Bearer {own.stdout.strip()}"}
    customers = requests.get(f"{stack.base}/views/customers", headers=auth, timeout=30)
    assert customers.status_code == 200 and customers.json()["rows"] == [], customers.text
    assert requests.get(f"{stack.base}/views/books", headers=auth, timeout=30).status_code == 403
    typo = cli(stack.env, "token", "--rows", "custmer_id=x")
    assert typo.returncode == 2 and "no view has a column 'custmer_id'" in typo.stderr

    topics = cli(stack.env, "topics")
    assert topics.returncode == 0 and "ok " in topics.stdout, topics.stderr

    exports = cli(stack.env, "env")
    assert exports.returncode == 0 and "export DATABASE_URL=" in exports.stdout, exports.stderr
    psql = cli(stack.env, shell='eval "$(logfold env)"; psql "$DATABASE_URL" -tAc "SELECT 42"')
    assert psql.returncode == 0 and psql.stdout.strip() == "42", psql.stderr

    busy = cli(stack.env, "reset", "--yes")
    assert busy.returncode == 1 and "running" in busy.stderr and data_dir.exists()


def test_outside_a_project_commands_say_what_to_do_and_write_nothing(tmp_path: Path) -> None:
    bare = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("LOGFOLD_") and k not in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL")
    }
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args in (["token"], ["api"], ["env"]):
        out = cli(bare, *args, cwd=elsewhere)
        assert out.returncode != 0, (args, out.stdout)
        assert "logfold run" in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
    assert list(elsewhere.iterdir()) == []  # no new secret, no data directory
    weak = cli({**bare, "LOGFOLD_JWT_SECRET": "change-me"}, "token", cwd=elsewhere)
    assert weak.returncode != 0 and "32" in weak.stderr, weak.stderr


@pytest.mark.parametrize(
    "args",
    [[], ["run"], ["api"], ["processor"], ["migrate"], ["topics"], ["token"], ["reset"], ["env"]],
)
def test_every_command_has_help(args: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stack.cli", *args, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Usage: " in out.stdout and len(out.stdout.splitlines()) > 3


def test_run_uses_external_kafka_and_postgres_when_configured(
    data_dir: Path, base_settings: Settings
) -> None:
    running = RunningStack(data_dir)
    prefix = f"ext{uuid.uuid4().hex[:6]}."
    running.env.update(
        {
            "KAFKA_BOOTSTRAP_SERVERS": base_settings.kafka(),
            "DATABASE_URL": base_settings.database(),
            "LOGFOLD_TOPIC_PREFIX": prefix,
            # Not about the projector's first seconds (the README flow starts it as a user does).
            "LOGFOLD_PROJECTOR_WARM_UP_ROUNDS": "0",
            "LOGFOLD_PROJECTOR_REBUILD_REHEARSAL_RECORDS": "0",
        }
    )
    try:
        token = running.start()
        output = "".join(running.output)
        assert "starting Kafka" not in output and "starting Postgres" not in output
        assert base_settings.kafka() in output
        r = requests.post(
            f"{running.base}/commands/register-customer",
            timeout=30,
            headers={"Authorization": f"Bearer {token}"},
            json={"data": {"name": "Ext", "email": "ext@example.com"}},
        )
        assert r.status_code == 201, r.text
        events = log_of(base_settings.model_copy(update={"topic_prefix": prefix}), "customer")
        assert [e.aggregate_id for e in events] == [r.json()["aggregate_id"]]
        assert running.interrupt() == 0
        assert not (data_dir / "kafka").exists() and not (data_dir / "pg").exists()
    finally:
        running.kill()
