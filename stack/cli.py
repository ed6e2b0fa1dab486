"""The `logfold` command."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import Any, Protocol

import click

from config.settings import Settings


def _settings() -> Settings:
    """From the environment; what it does not set comes from the local stack that `logfold run`
    is running in this project, if any (see stack/stack_env.py)."""
    from stack import stack_env

    return stack_env.settings()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Logfold: commands in, events to Kafka, views out.

    Configuration comes from the environment (LOGFOLD_*, KAFKA_BOOTSTRAP_SERVERS, DATABASE_URL);
    see docs/configuration.md for every setting.
    """


@main.command()
@click.option("--processors", type=int, default=None, help="Command processor processes.")
@click.option(
    "--cluster",
    is_flag=True,
    help="The cluster topology on this machine: 3 Kafka nodes, a Spark master with 2 workers, "
    "2 command processors, 2 API nodes behind HAProxy (data apart, in <data>/cluster).",
)
def run(processors: int | None, cluster: bool) -> None:
    """Run the whole stack locally: Kafka, Postgres, command processing and the API.

    Kafka and Postgres are started from the project's own data directory unless
    KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL point at existing ones. Ctrl-C stops everything.
    """
    from config import logs
    from stack import local
    from stack.topics import TopicMisconfigured

    settings = Settings()  # its own configuration only: not another stack's endpoints
    # For the person at the terminal: text (unless LOGFOLD_LOG_FORMAT says), prefixed `run`.
    text = "log_format" not in settings.model_fields_set
    logs.configure(settings.log_level, "text" if text else settings.log_format, process="run")
    if processors is not None:
        settings.processors = processors
    try:
        local.run(settings, cluster=cluster)
    except (RuntimeError, TimeoutError, TopicMisconfigured) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


@main.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def reset(yes: bool) -> None:
    """Delete the local stack's data (Kafka log, Postgres, dev secret). Stop `run` first."""
    from stack import stack_env

    settings = Settings()
    running = stack_env.read(settings)
    if running is not None:
        click.echo(
            f"error: the local stack is running (`logfold run`, pid {running[stack_env.PID]}); "
            "stop it with Ctrl-C first",
            err=True,
        )
        sys.exit(1)
    path = settings.data_path
    if not path.exists():
        click.echo(f"nothing to reset: {path} does not exist")
        return
    if not yes:
        click.confirm(f"Delete everything under {path}?", abort=True)
    shutil.rmtree(path)
    click.echo(f"deleted {path}")


@main.command()
def env() -> None:
    """Print `export` lines for the local stack that `logfold run` is running here.

    In a new shell: eval "$(logfold env)"; then psql "$DATABASE_URL", curl with a token from
    `logfold token`, or any other tool sees the same stack.
    """
    from stack import stack_env

    settings = Settings()
    running = stack_env.read(settings)
    if running is None:
        click.echo(
            f"error: no local stack is running here (no {stack_env.path(settings)}); start one "
            "with `logfold run` in the project directory (or set LOGFOLD_DATA_DIR to its data)",
            err=True,
        )
        sys.exit(1)
    click.echo(stack_env.exports(running), nl=False)


@main.command()
@click.option("--host", default=None, help="Interface to listen on (LOGFOLD_API_HOST).")
@click.option("--port", type=int, default=None, help="Port (LOGFOLD_API_PORT).")
@click.option(
    "--workers", type=int, default=None, help="API processes (LOGFOLD_API_WORKERS, default 2)."
)
def api(host: str | None, port: int | None, workers: int | None) -> None:
    """Serve the HTTP API (needs Kafka, Postgres and LOGFOLD_JWT_SECRET)."""
    from config import logs
    from stack.serve import ApiServer

    settings = _settings()
    if settings.api_worker == "gevent" and "gevent.monkey" not in sys.modules:
        # Start again in a process patched before anything imports Kafka or psycopg.
        os.execv(sys.executable, [sys.executable, "-m", "stack.patched", *sys.argv[1:]])
    logs.configure(settings.log_level, settings.log_format)
    settings.api_host = host or settings.api_host
    settings.api_port = port or settings.api_port
    settings.jwt_secret = _secret(settings)
    _require_topics(settings)
    ApiServer(settings, workers or settings.api_workers).run()


@main.command()
def processor() -> None:
    """Run a command processor (one member of the processors' consumer group)."""
    from commands.processor import CommandProcessor

    _serve(CommandProcessor)


@main.command()
def projector() -> None:
    """Run the Spark projector: folds the event log into the read views, continuously."""
    from spark.projector import Projector

    _serve(Projector)


@main.command()
@click.option(
    "--drop-slot",
    is_flag=True,
    help="Drop the replication slot and publication instead (frees the WAL they hold; the next "
    "start takes a new first snapshot).",
)
def cdc(drop_slot: bool) -> None:
    """Stream the view tables' (and registered plain tables') changes from the Postgres WAL
    into the compacted cdc.<table> topics (see docs/cdc.md)."""
    from cdc.capture import Capture, drop
    from config.settings import slot_name

    if drop_slot:
        settings = _settings()
        found = drop(settings)
        click.echo(f"{'dropped' if found else 'no'} slot {slot_name(settings)}")
        return
    _serve(Capture)


@main.command("webhooks")
def webhooks_() -> None:
    """Deliver view changes to the registered webhook endpoints: one worker per endpoint, each
    from its durable cursor (see docs/webhooks.md)."""
    from webhooks.dispatcher import Dispatcher

    _serve(Dispatcher)


class _Service(Protocol):
    def run(self) -> None: ...
    def stop(self) -> None: ...


def _serve(make: Callable[[Settings], _Service]) -> None:
    """Run a long-lived worker until SIGTERM or Ctrl-C, after checking the topics."""
    import signal

    from config import logs

    settings = _settings()
    logs.configure(settings.log_level, settings.log_format)
    _require_topics(settings)
    service = make(settings)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    service.run()


@main.command()
@click.argument("projections", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Rebuild every projection and join.")
@click.option("--verify", is_flag=True, help="Compare the rebuilt views with the live ones.")
@click.option(
    "--here",
    is_flag=True,
    help="Rebuild in a Spark driver of this command's own, even with a projector running.",
)
def rebuild(projections: tuple[str, ...], everything: bool, verify: bool, here: bool) -> None:
    """Rebuild projections by replaying the whole log, and joined views from their tables'
    changelogs (readers keep the old view until the swap).

    A running projector that folds the same versions of them does it, in its warm Spark driver
    (it shows in `logfold projections`); otherwise, or with --here, this command starts a
    driver of its own. Exits 1 when --verify finds a difference.
    """
    from config import logs
    from projections.registry import JOINS, PROJECTIONS

    known = [*PROJECTIONS, *JOINS]
    if everything == bool(projections):
        raise click.UsageError(f"name projections or give --all; known: {', '.join(known)}")
    unknown = [p for p in projections if p not in known]
    if unknown:
        raise click.UsageError(f"unknown projection(s) {unknown}; known: {', '.join(known)}")
    settings = _settings()
    logs.configure("warning", settings.log_format)
    _require_topics(settings)
    chosen = projections or tuple(known)
    reports = None if here else _ask_the_projector_unless_away(settings, chosen, verify)
    if reports is None:
        reports = _rebuild_here(settings, chosen, verify)
    differences = 0
    for report in reports:
        name = report["projection"]
        events, seconds = report["events"], report["seconds"]
        rate = events / seconds if seconds else 0.0
        rows = ", ".join(f"{t}: {n} rows" for t, n in report["rows"].items())
        click.echo(f"{name}: {events} events in {seconds:.1f}s ({rate:,.0f} events/s); {rows}")
        parked, skipped = (report.get(f) or 0 for f in ("parked_aggregates", "skipped_events"))
        if parked or skipped:
            click.echo(
                f"  left out, as the live view leaves them out: the parked events of {parked} "
                f"aggregates, {skipped} skipped events (logfold dead-letters list {name})"
            )
        for table, diff in (report.get("differences") or {}).items():
            differences += len(diff)
            status = "identical to the live view" if not diff else f"{len(diff)} differences"
            click.echo(f"  verify {table}: {status}")
            for row in diff[:10]:
                click.echo(f"    {tuple(row)}")
    if differences:
        sys.exit(1)


CLAIM_S = 10.0  # how long a running projector has to take a rebuild asked of it
SILENT_S = 20.0  # a projector rebuilding that has not beaten for this long is taken for gone


def _ask_the_projector_unless_away(
    settings: Settings, chosen: tuple[str, ...], verify: bool
) -> list[dict[str, Any]] | None:
    import psycopg

    try:
        return _ask_the_projector(settings, chosen, verify)
    except psycopg.OperationalError as e:
        click.echo(
            f"error: Postgres is out of reach ({str(e).strip().splitlines()[0]}); start the "
            "stack (`logfold run`) or point DATABASE_URL at it",
            err=True,
        )
        sys.exit(2)


def _ask_the_projector(
    settings: Settings, chosen: tuple[str, ...], verify: bool
) -> list[dict[str, Any]] | None:
    """The reports of the rebuild of `chosen` by the running projector; None when no projector
    took it (none runs, or it folds other versions) or it stopped on the way."""
    import time

    import psycopg
    from tqdm import tqdm

    from config.settings import PROJECTOR_BEAT_S
    from projections.base import rebuilds
    from projections.registry import JOINS, PROJECTIONS

    asked = rebuilds.versions_of(
        [PROJECTIONS[n] for n in chosen if n in PROJECTIONS],
        [JOINS[n] for n in chosen if n in JOINS],
    )
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        age = rebuilds.projector_beat_age(conn)
        if age is None or age > 3 * PROJECTOR_BEAT_S:
            return None
        request = rebuilds.ask(conn, asked, verify)
        taken_by = time.monotonic() + CLAIM_S
        bar: tqdm[Any] | None = None
        told = False
        try:
            while True:
                state = rebuilds.state(conn, request)
                if state is None:  # deleted by hand
                    return None
                if state.claimed_by is not None and not told:
                    told = True
                    click.echo(
                        f"the running projector ({state.claimed_by}) is rebuilding (request "
                        f"{request}); stopping this command leaves it going",
                        err=True,
                    )
                if state.claimed_by is None:
                    if time.monotonic() > taken_by and rebuilds.withdraw(conn, request):
                        click.echo(
                            f"the running projector did not take the rebuild within {CLAIM_S:.0f}s "
                            "(it folds other versions of these projections, or is busy); "
                            "rebuilding here",
                            err=True,
                        )
                        return None
                elif state.finished:
                    if state.error is not None:
                        click.echo(
                            f"error: the projector ({state.claimed_by}) could not rebuild: "
                            f"{state.error} (its log has the rest)",
                            err=True,
                        )
                        sys.exit(1)
                    return state.reports or []
                elif (state.beat_age_s or 0.0) > SILENT_S:
                    rebuilds.finish(conn, request, error="its projector went silent")
                    click.echo(
                        f"the projector ({state.claimed_by}) went silent mid-rebuild; "
                        "rebuilding here",
                        err=True,
                    )
                    return None
                elif state.total:
                    if bar is None:
                        bar = tqdm(total=state.total, unit="ev", desc="rebuild (by the projector)")
                    bar.update((state.done or 0) - bar.n)
                time.sleep(0.5)
        finally:
            if bar is not None:
                bar.close()


def _rebuild_here(
    settings: Settings, chosen: tuple[str, ...], verify: bool
) -> list[dict[str, Any]]:
    """Rebuild `chosen` in a Spark driver of this process's own."""
    import dataclasses

    from projections.registry import JOINS, PROJECTIONS
    from spark.join import JoinRebuild
    from spark.rebuild import Rebuild
    from spark.session import session

    spark = session(settings, "logfold-rebuild")
    job, joins = Rebuild(settings, spark), JoinRebuild(settings, spark)
    # Every projection named is rebuilt from one read of the log; then the joins, which read
    # the rebuilt tables' changelogs.
    reports = job.run_many([PROJECTIONS[n] for n in chosen if n in PROJECTIONS], verify=verify)
    reports += [joins.run(JOINS[n], verify=verify) for n in chosen if n in JOINS]
    return [dataclasses.asdict(r) for r in reports]


@main.command("projections")
@click.option(
    "--watch",
    is_flag=True,
    help="Draw the builds under way as progress bars until they are swapped in or fail.",
)
def projections_(watch: bool) -> None:
    """List each projection: the version this code folds, the version its live tables were
    built by, a build under way (with its progress) or failed (a changed projection is built
    beside the live one and swapped in by the projector: docs/operations.md), its lag, its
    parked events, and the earlier versions kept for a rollback."""
    import psycopg

    from app.read_model import ReadModel
    from projections.base import rebuilds, versions
    from projections.registry import PROJECTIONS
    from spark import keeping

    settings = _settings()
    model = ReadModel(settings)
    try:
        if watch:
            _watch_builds(model)
        lag = model.lag()
    finally:
        model.close()
    with psycopg.connect(settings.database()) as conn:
        kept = keeping.kept(conn)
    click.echo(
        f"{'projection':<20} {'version':<13} {'live':<13} {'lag':>8} {'parked':>7}  "
        f"{'kept':<13}  state"
    )
    for name, p in PROJECTIONS.items():
        mine, shown = versions.of(p), lag.get(name, {})
        live = shown.get("version") or "-"
        if "building_version" in shown:
            state = f"building {shown['building_version']} since {shown.get('build_started_at')}"
            if "build_total" in shown:
                state += "  " + _meter(shown["build_done"], shown["build_total"])
        elif "build_error" in shown:
            state = f"build failed: {shown['build_error']}"
        elif live not in ("-", mine):
            state = "another version is live: the projector builds this one"
        elif "failed" in shown:
            state = f"failed: {shown['failed'].get('error')}"
        else:
            state = "live"
        if report := shown.get("build_report"):
            changed = ", ".join(
                f"{t} -{c['only_in_old']}/+{c['only_in_new']} rows"
                for t, c in report["tables"].items()
            )
            state += f" (its build changed {changed})"
        mine_kept = ",".join(k.version for k in kept if k.projection == name) or "-"
        click.echo(
            f"{name:<20} {mine:<13} {live:<13} {shown.get('events', 0):>8} "
            f"{shown.get('parked_events', 0):>7}  {mine_kept:<13}  {state}"
        )
    with psycopg.connect(settings.database()) as conn:
        asked = rebuilds.unfinished(conn)
    for request in asked:
        if request.claimed_by is None:
            where = "waiting for a projector to take it"
        elif (request.beat_age_s or 0.0) > SILENT_S:
            where = f"stopped: its projector {request.claimed_by} went silent"
        else:
            where = f"by the projector {request.claimed_by}"
            if request.total:
                where += "  " + _meter(request.done or 0, request.total)
        click.echo(f"rebuild {request.id} ({', '.join(request.versions)}): {where}")


def _meter(done: int, total: int) -> str:
    from tqdm import tqdm

    meter = tqdm.format_meter(
        done, total, 0, ncols=40, unit="ev", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}"
    )
    return str(meter)


def _watch_builds(model: Any) -> None:
    """Progress bars of the builds under way, from what the projector records, until none is."""
    import time

    from tqdm import tqdm

    bars: dict[str, tqdm] = {}
    try:
        while True:
            building = {n: f for n, f in model.lag().items() if "building_version" in f}
            for name in [n for n in bars if n not in building]:
                bars.pop(name).close()
            if not building:
                return
            for name, shown in building.items():
                if name not in bars:
                    bars[name] = tqdm(
                        desc=f"{name} {shown['building_version']}", unit="ev", position=len(bars)
                    )
                bar = bars[name]
                if "build_total" in shown:
                    bar.total = shown["build_total"]
                    bar.n = shown["build_done"]
                bar.refresh()
            time.sleep(1)
    finally:
        for bar in bars.values():
            bar.close()


@main.group("dead-letters")
def dead_letters() -> None:
    """Events a projection's fold could not apply, parked with every later event of their
    aggregate while the rest flows: list them, retry them once the fold is fixed, or skip them
    on purpose (see docs/operations.md, Dead letters)."""


def _projection(name: str) -> str:
    from projections.registry import PROJECTIONS

    if name not in PROJECTIONS:
        raise click.BadParameter(
            f"unknown projection {name!r}; known: {', '.join(PROJECTIONS)}", param_hint="PROJECTION"
        )
    return name


@dead_letters.command("list")
@click.argument("projection", required=False)
@click.option("--aggregate", help="Only this aggregate's (for a stream, this key's) events.")
@click.option("--skipped", is_flag=True, help="The events skipped on purpose instead.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
def dead_letters_list(
    projection: str | None, aggregate: str | None, skipped: bool, limit: int
) -> None:
    """List parked events (of PROJECTION, or every projection), in log order."""
    import psycopg

    from projections.base import dead_letters as store

    if projection is not None:
        _projection(projection)
    table = "skipped_events" if skipped else "parked_events"
    with psycopg.connect(_settings().database()) as conn:
        found = store.letters(conn, projection, aggregate, limit, table=table)
        summaries = store.summaries(conn)
    for name, summary in sorted(summaries.items()):
        if projection in (None, name):
            click.echo(
                f"{name}: {summary.parked_events} parked events of "
                f"{summary.parked_aggregates} aggregates, {summary.skipped_events} skipped"
            )
    for letter in found:
        click.echo(
            f"  {letter.projection}  {letter.aggregate}  "
            f"{letter.topic}:{letter.partition}:{letter.offset}  {letter.error}"
        )
    if not found:
        click.echo("nothing skipped" if skipped else "nothing parked")


@dead_letters.command("retry")
@click.argument("projection")
@click.option("--aggregate", help="Only this aggregate's events (default: every one parked).")
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait while the projector applies them, with a progress bar.",
)
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait.")
def dead_letters_retry(projection: str, aggregate: str | None, wait: bool, timeout: float) -> None:
    """Ask the running projector to apply PROJECTION's parked events again, in order (after a
    fix to its fold is deployed). An event that fails again stops its aggregate there, with
    its new error. Exits 1 if any is still parked when the wait ends."""
    import time

    import psycopg
    from tqdm import tqdm

    from projections.base import dead_letters as store

    _projection(projection)
    with psycopg.connect(_settings().database()) as conn:
        asked = store.request_retry(conn, projection, aggregate)
    click.echo(f"asked the projector to retry {asked} parked events of {projection}")
    if not wait or not asked:
        return

    def still() -> tuple[int, int]:
        with psycopg.connect(_settings().database()) as conn:
            row = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE retry_requested_at IS NOT NULL) "
                "FROM parked_events WHERE projection = %s AND (%s::text IS NULL OR aggregate = %s)",
                (projection, aggregate, aggregate),
            ).fetchone()
        return (row[0], row[1]) if row else (0, 0)

    deadline = time.monotonic() + timeout
    with tqdm(total=asked, unit="ev", desc=f"retry {projection}") as bar:
        while True:
            parked, waiting = still()
            bar.n = max(0, asked - waiting)
            bar.refresh()
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    if parked:
        click.echo(
            f"{parked} events still parked (logfold dead-letters list {projection}); "
            + ("the wait ended" if waiting else "one failed again")
        )
        sys.exit(1)
    click.echo("every parked event applied")


@dead_letters.command("skip")
@click.argument("projection")
@click.option("--aggregate", required=True, help="The aggregate (for a stream, the key).")
@click.option("--reason", required=True, help="Why: recorded with what is skipped.")
@click.option(
    "--every",
    is_flag=True,
    help="Skip every parked event of the aggregate, not only the first (the one that failed).",
)
def dead_letters_skip(projection: str, aggregate: str, reason: str, every: bool) -> None:
    """Skip, on purpose and on record, the parked event of PROJECTION that failed for the
    aggregate (and, with --every, the ones behind it); the rest are retried. The view then
    differs from the fold of the log by exactly what is skipped (`list --skipped`; a
    rebuild leaves the same out)."""
    import psycopg

    from projections.base import dead_letters as store

    _projection(projection)
    with psycopg.connect(_settings().database()) as conn:
        skipped = store.skip(conn, projection, aggregate, reason, every)
    if not skipped:
        click.echo(f"nothing of {aggregate} is parked in {projection}")
        sys.exit(1)
    for letter in skipped:
        click.echo(f"skipped {letter.topic}:{letter.partition}:{letter.offset}  {letter.error}")


@main.command()
def migrate() -> None:
    """Apply the Alembic migrations to DATABASE_URL (alembic upgrade head).

    With LOGFOLD_API_DATABASE_URL set, its user is then made the API's login: created if
    missing, given the URL's password, a member of logfold_reader (reads the views, writes
    nothing).
    """
    import psycopg

    from stack.migrate import ensure_login, upgrade

    settings = _settings()
    upgrade(settings.database())
    click.echo("database is at the latest revision")
    if settings.api_database_url:
        try:
            role = ensure_login(settings.database(), settings.api_database_url)
        except (ValueError, psycopg.errors.InsufficientPrivilege) as e:
            click.echo(
                f"error: cannot make the API's login ({str(e).strip()}); as an administrator: "
                "CREATE ROLE <user> LOGIN PASSWORD '…' IN ROLE logfold_reader",
                err=True,
            )
            sys.exit(1)
        click.echo(
            f"the API logs in as {role}: a member of logfold_reader, reads the views only "
            "(and of logfold_webhooks: registers webhook endpoints)"
        )


@main.command()
@click.option("--create", is_flag=True, help="Create missing topics before checking.")
def topics(create: bool) -> None:
    """Check (and with --create, create) every Kafka topic Logfold uses."""
    from config.topics import Topics
    from stack.topics import create_topics, topic_specs

    settings = _settings()
    if create:
        for name in create_topics(settings):
            click.echo(f"created {name}")
    _require_topics(settings)
    for spec in topic_specs(Topics(settings.topic_prefix)):
        click.echo(f"ok  {spec.name:<28} {spec.purpose}")


@main.command()
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    type=click.Choice(["commands:write", "views:read", "streams:write", "admin"]),
    help="Scope to grant (repeatable); all scopes by default.",
)
@click.option("--subject", default="developer", show_default=True, help="The token's subject.")
@click.option(
    "--ttl",
    type=click.IntRange(min=1),
    default=None,
    help="Lifetime in seconds; at most, and by default, what the API accepts "
    "(LOGFOLD_JWT_MAX_TTL_S, 86400).",
)
@click.option(
    "--rows",
    "rows",
    multiple=True,
    metavar="COLUMN=VALUE",
    help="Restrict reads and subscriptions to rows with this value (repeatable), e.g. "
    "customer_id=c-1: views with the column show only those rows, views without it are 403.",
)
def token(scopes: tuple[str, ...], subject: str, ttl: int | None, rows: tuple[str, ...]) -> None:
    """Print a bearer token signed with LOGFOLD_JWT_SECRET (or the local stack's secret), for
    the audience LOGFOLD_JWT_AUDIENCE."""
    from app.auth import SCOPES, issue_token
    from projections.registry import VIEWS

    settings = _settings()
    longest = settings.jwt_max_ttl_s
    if ttl is not None and ttl > longest:
        raise click.BadParameter(
            f"{ttl} s is longer than the API accepts ({longest} s, LOGFOLD_JWT_MAX_TTL_S): it "
            f"would refuse the token. Ask for at most {longest} s, or raise "
            "LOGFOLD_JWT_MAX_TTL_S for the API and here alike",
            param_hint="--ttl",
        )
    known = sorted({c for _, view in VIEWS.values() for c in view.columns})
    claim = {}
    for item in rows:
        column, sep, value = item.partition("=")
        if not sep or not column or not value:
            raise click.BadParameter(f"{item!r} is not COLUMN=VALUE", param_hint="--rows")
        if column not in known:
            raise click.BadParameter(
                f"no view has a column {column!r}; columns: {', '.join(known)}",
                param_hint="--rows",
            )
        claim[column] = value
    click.echo(
        issue_token(
            _secret(settings),
            subject,
            scopes or SCOPES,
            ttl or longest,
            claim or None,
            audience=settings.jwt_audience,
        )
    )


def _secret(settings: Settings) -> str:
    from stack.local import secret_for

    try:
        return secret_for(settings)
    except (RuntimeError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def _require_topics(settings: Settings) -> None:
    from stack.topics import TopicMisconfigured, check_topics

    try:
        check_topics(settings)
    except TopicMisconfigured as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
