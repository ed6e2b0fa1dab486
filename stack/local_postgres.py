"""A Postgres server from the Debian binaries, with its own data directory and port, configured
for logical decoding, with password authentication. Run as the unprivileged `postgres` user
when started by root."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from psycopg import sql

from stack.procs import is_root, stop_process, wait_until
from stack.stack_env import write_private

SERVER_CONF = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "wal_level": "logical",
    "max_replication_slots": "64",
    "max_wal_senders": "32",
    "max_slot_wal_keep_size": "2GB",
    "max_connections": "200",
    "shared_buffers": "256MB",
    "log_min_messages": "warning",
}


def _method(line: str) -> str | None:
    """The auth method of a pg_hba.conf line (its last field), None for comments."""
    fields = line.split("#", 1)[0].split()
    return fields[-1] if fields else None


def find_bindir() -> Path:
    """The newest installed server binaries (Debian keeps them under /usr/lib/postgresql/N/bin)."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if candidates:
        return candidates[-1].parent
    found = shutil.which("postgres")
    if found:
        return Path(found).parent
    raise RuntimeError(
        "Postgres server binaries not found; install them with "
        "`apt-get install -y postgresql` (the README's `make` targets do this for you)"
    )


class LocalPostgres:
    """Password authentication (scram-sha-256) on 127.0.0.1 only: the `logfold` role's password
    is generated into the data directory (mode 0600) when the server is first made."""

    def __init__(self, data_dir: Path, port: int, database: str = "logfold") -> None:
        self.bindir = find_bindir()
        self.data_dir = data_dir
        self.port = port
        self.database = database
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def password_file(self) -> Path:
        return self.data_dir / "password"

    def password(self) -> str:
        if not self.password_file.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            write_private(self.password_file, secrets.token_urlsafe(24), replace=False)
            if is_root():  # initdb, run as the server's user, reads it
                pw = pwd.getpwnam("postgres")
                os.chown(self.password_file, pw.pw_uid, pw.pw_gid)
        return self.password_file.read_text().strip()

    def api_url(self, role: str = "logfold_api") -> str:
        """A login for the API that can read the views and write nothing: a member of
        `logfold_reader` (made by the migrations), with its own generated password."""
        from stack.migrate import ensure_login

        secret = self.data_dir / f"{role}-password"
        if not secret.exists():
            write_private(secret, secrets.token_urlsafe(24), replace=False)
        password = secret.read_text().strip()
        url = f"postgresql://{role}:{password}@127.0.0.1:{self.port}/{self.database}"
        ensure_login(self._url(self.database), url)
        return url

    def _password_file_made(self) -> Path:
        self.password()
        return self.password_file

    @property
    def url(self) -> str:
        return self._url(self.database)

    def _as_owner(self) -> dict[str, Any]:
        """Run as the server's user, from a directory it can enter: the caller's own may be
        private (a checkout in a 0700 folder), and initdb says so on stderr."""
        owner: dict[str, Any] = {"cwd": self.data_dir}
        if is_root():
            owner.update(user="postgres", group="postgres")
        return owner

    def _prepare_dir(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if is_root():
            pw = pwd.getpwnam("postgres")
            os.chown(self.data_dir, pw.pw_uid, pw.pw_gid)
            # The server user must be able to reach its data directory.
            for parent in self.data_dir.resolve().parents:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    parent.chmod(mode | 0o001)
        self.data_dir.chmod(0o700)

    def start(self, timeout: float = 60.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Make the data directory the first time (initdb) and start the server, without
        waiting for it to accept connections."""
        pgdata = self.data_dir / "pgdata"
        if not (pgdata / "PG_VERSION").exists():
            self._prepare_dir()
            subprocess.run(
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    str(pgdata),
                    "-U",
                    "logfold",
                    "-A",
                    "scram-sha-256",
                    f"--pwfile={self._password_file_made()}",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                    # Text compared by its bytes: the same order as C.UTF-8's (code points),
                    # but Postgres sorts and indexes it without the C library's collation
                    # (index builds and sorts of ids ~2x faster, `docs/benchmarks-journal.md`).
                    "--lc-collate=C",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                **self._as_owner(),
            )
        args = [str(self.bindir / "postgres"), "-D", str(pgdata), "-p", str(self.port)]
        for key, value in SERVER_CONF.items():
            args += ["-c", f"{key}={value}"]
        log = (self.data_dir / "postgres.log").open("ab")
        if is_root():
            os.chown(log.name, pwd.getpwnam("postgres").pw_uid, -1)
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **self._as_owner()
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the server accepts connections; then its passwords and database made."""
        log = self.data_dir / "postgres.log"
        wait_until(self._ready, timeout, f"Postgres on port {self.port} (log: {log})")
        self._require_passwords(self.data_dir / "pgdata")
        self._ensure_database()

    def _ready(self) -> bool:
        import psycopg

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"Postgres exited with {self.proc.returncode}; see {self.data_dir}")
        with psycopg.connect(self._url("postgres"), connect_timeout=2):
            return True

    def _url(self, database: str) -> str:
        return f"postgresql://logfold:{self.password()}@127.0.0.1:{self.port}/{database}"

    def _require_passwords(self, pgdata: Path) -> None:
        """A data directory made before passwords (`initdb -A trust`) gets one now: the role's
        password set, then every `trust` line of pg_hba.conf made `scram-sha-256`."""
        import psycopg

        hba = pgdata / "pg_hba.conf"
        lines = hba.read_text().splitlines(keepends=True)
        trusting = [i for i, line in enumerate(lines) if _method(line) == "trust"]
        if not trusting:
            return
        with psycopg.connect(self._url("postgres"), autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER ROLE logfold PASSWORD {}").format(sql.Literal(self.password()))
            )
            for i in trusting:
                lines[i] = lines[i].rstrip()[: -len("trust")] + "scram-sha-256\n"
            hba.write_text("".join(lines))  # keeps its owner (the server's user) and mode
            conn.execute("SELECT pg_reload_conf()")

    def _ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(self._url("postgres"), autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if not exists:
                # The data directory may predate `--lc-collate=C`: the database is C anyway.
                conn.execute(
                    f'CREATE DATABASE "{self.database}" TEMPLATE template0 '
                    "LC_COLLATE 'C' LC_CTYPE 'C.UTF-8'"
                )

    def stop(self) -> None:
        if self.proc is not None:
            # SIGTERM is Postgres's "smart" shutdown; SIGINT ("fast") does not wait for clients.
            self.proc.send_signal(2)
            stop_process(self.proc, timeout=30)
            self.proc = None
