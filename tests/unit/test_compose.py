"""docker-compose.yml is a valid Compose file and has the topology the design describes.

There is no Docker engine on the build machines, so `docker compose config` cannot check the file.
Instead it is validated against the official Compose Specification JSON schema, vendored in
stack/compose/ (see the README there for its origin), plus assertions about the layout.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from jsonschema.validators import validator_for

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = ROOT / "stack" / "compose" / "compose-spec.json"
# The vendored file as shipped in check-jsonschema 0.39.0; update together with the README.
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"

BROKERS = {"kafka-1", "kafka-2", "kafka-3"}
SPARK = {"spark-master", "spark-worker-1", "spark-worker-2"}
INFRA_SERVICES = {*BROKERS, "postgres", "lb", *SPARK}
API_NODES = {"api-1", "api-2"}
APP_SERVICES = {"migrate", "processor", *API_NODES, "projector", "cdc", "webhooks"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> Any:
    # Use the draft the schema declares in "$schema" (2020-12: it relies on
    # unevaluatedProperties, which older drafts silently ignore).
    cls = validator_for(schema)
    cls.check_schema(schema)
    # No format checker: Compose durations ("10s") are not ISO 8601 durations.
    return cls(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return data


def _errors(validator: Any, document: dict[str, Any]) -> list[ValidationError]:
    return sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))


def _all_messages(errors: list[ValidationError]) -> str:
    """Messages of the errors and of their sub-errors (allOf/oneOf branches)."""
    out: list[str] = []
    stack = list(errors)
    while stack:
        err = stack.pop()
        out.append(err.message)
        stack.extend(err.context or [])
    return "\n".join(out)


def _depends_on_targets(service: dict[str, Any]) -> list[str]:
    deps = service.get("depends_on") or []
    return list(deps)  # list form, or the keys of the long (mapping) form


# --- the vendored schema ----------------------------------------------------------------------


def test_vendored_schema_is_the_recorded_upstream_file() -> None:
    digest = hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest()
    assert digest == SCHEMA_SHA256, "stack/compose/compose-spec.json changed; see its README"


def test_schema_declares_draft_2020_12(schema: dict[str, Any], validator: Any) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert isinstance(validator, Draft202012Validator)


# --- the compose file against the schema ------------------------------------------------------


def test_compose_file_is_valid_against_compose_spec(
    validator: Any, compose: dict[str, Any]
) -> None:
    errors = _errors(validator, compose)
    details = "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    assert not errors, f"docker-compose.yml violates the Compose Specification:\n{details}"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        # A typo'd key inside a service (unevaluatedProperties: false).
        (
            lambda doc: doc["services"]["api-1"].__setitem__(
                "enviroment", doc["services"]["api-1"].pop("environment")
            ),
            "enviroment",
        ),
        # A typo'd top-level key.
        (lambda doc: doc.__setitem__("servcies", doc.pop("services")), "servcies"),
        # A wrong type deep inside a service (replicas may be an integer or a "${VAR}" string).
        (
            lambda doc: doc["services"]["processor"]["deploy"].__setitem__("replicas", [2]),
            "[2] is not of type",
        ),
        # An unknown depends_on condition.
        (
            lambda doc: doc["services"]["api-1"]["depends_on"]["migrate"].__setitem__(
                "condition", "service_finished"
            ),
            "service_finished",
        ),
    ],
    ids=["service-key-typo", "top-level-key-typo", "replicas-wrong-type", "bad-condition"],
)
def test_broken_copies_fail_validation(
    validator: Any, compose: dict[str, Any], mutate: Any, expected: str
) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    errors = _errors(validator, broken)
    assert errors, "a deliberately broken compose document passed schema validation"
    assert expected in _all_messages(errors)


# --- topology ---------------------------------------------------------------------------------


def test_expected_services_exist(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == INFRA_SERVICES | APP_SERVICES


def test_every_app_service_uses_the_same_build_and_image(compose: dict[str, Any]) -> None:
    services = compose["services"]
    builds = {json.dumps(services[name].get("build"), sort_keys=True) for name in APP_SERVICES}
    images = {services[name].get("image") for name in APP_SERVICES}
    assert len(builds) == 1 and len(images) == 1, (builds, images)
    build = services["api-1"]["build"]
    assert build["context"] == "." and build["dockerfile"] == "Dockerfile"
    assert (ROOT / build["dockerfile"]).is_file()
    assert images != {None}


def test_app_commands(compose: dict[str, Any]) -> None:
    services = compose["services"]
    migrate_cmd = " ".join(services["migrate"]["entrypoint"] + services["migrate"]["command"])
    assert "logfold migrate" in migrate_cmd
    assert "logfold topics --create" in migrate_cmd
    assert services["migrate"]["restart"] == "no"
    assert services["processor"]["command"] == ["processor"]
    for node in API_NODES:
        assert services[node]["command"][:2] == ["api", "--host"]
    assert services["projector"]["command"] == ["projector"]
    assert services["cdc"]["command"] == ["cdc"]
    assert services["webhooks"]["command"] == ["webhooks"]
    # The API is the balancer's port, published on the loopback interface only; the nodes are
    # reached through it.
    assert services["lb"]["ports"] == ["127.0.0.1:${LOGFOLD_API_HOST_PORT:-8000}:8000"]
    for service in services.values():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), port
    for node in API_NODES:
        assert "ports" not in services[node]
        assert "localhost:8000/health/live" in " ".join(services[node]["healthcheck"]["test"])


def test_app_environment(compose: dict[str, Any]) -> None:
    for name in APP_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka-1:9092,kafka-2:9092,kafka-3:9092", name
        assert env["LOGFOLD_REPLICATION_FACTOR"] == "3", name
        if name not in API_NODES:  # the API has a login of its own (test below)
            assert env["DATABASE_URL"].startswith("postgresql://logfold:${LOGFOLD_PG_PASSWORD:?")
            assert env["DATABASE_URL"].endswith("}@postgres:5432/logfold"), name
        # Required, with no fallback: Compose refuses to start without it, saying why.
        assert env["LOGFOLD_JWT_SECRET"].startswith("${LOGFOLD_JWT_SECRET:?"), name
        assert "32 bytes" in env["LOGFOLD_JWT_SECRET"], name
        assert "LOGFOLD_TOPIC_PREFIX" in env, name


def test_the_api_logs_in_as_the_reader_and_never_as_the_owner(compose: dict[str, Any]) -> None:
    """As under `logfold run`: the API's login (`logfold_api`, a member of `logfold_reader`,
    made by `migrate`) reads the views and writes nothing; the owner's password is not in the
    API's environment at all."""
    services = compose["services"]
    migrate = services["migrate"]["environment"]
    for node in API_NODES:
        api = services[node]["environment"]
        url = api["LOGFOLD_API_DATABASE_URL"]
        assert url.startswith("postgresql://logfold_api:${LOGFOLD_API_PG_PASSWORD:?"), url
        assert url.endswith("}@postgres:5432/logfold"), url
        assert "DATABASE_URL" not in api and "LOGFOLD_DATABASE_URL" not in api
        assert not any("LOGFOLD_PG_PASSWORD" in str(value) for value in api.values()), api
    # `logfold migrate` makes the login it is given (after the migrations that make the role).
    assert migrate["LOGFOLD_API_DATABASE_URL"] == url
    assert migrate["DATABASE_URL"].startswith("postgresql://logfold:${LOGFOLD_PG_PASSWORD:?")
    for name in APP_SERVICES - API_NODES - {"migrate"}:  # the writers keep the owner's login
        assert "LOGFOLD_API_DATABASE_URL" not in services[name]["environment"], name


def test_no_secret_has_a_default(compose: dict[str, Any]) -> None:
    """A default in a public file is a secret everyone knows (`${X:-…}` / `${X-…}`)."""
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    for variable in ("LOGFOLD_JWT_SECRET", "LOGFOLD_PG_PASSWORD", "LOGFOLD_API_PG_PASSWORD"):
        assert f"${{{variable}:-" not in text and f"${{{variable}-" not in text, variable
        assert f"${{{variable}:?" in text, variable
    postgres = compose["services"]["postgres"]["environment"]
    assert postgres["POSTGRES_PASSWORD"].startswith("${LOGFOLD_PG_PASSWORD:?")
    assert "change-me" not in text


def test_postgres_has_logical_decoding(compose: dict[str, Any]) -> None:
    postgres = compose["services"]["postgres"]
    command = postgres["command"]
    command = command if isinstance(command, str) else " ".join(command)
    for setting in (
        "wal_level=logical",
        "max_replication_slots=10",
        "max_wal_senders=10",
        "max_slot_wal_keep_size=1GB",
    ):
        assert setting in command
    assert postgres["image"] == "postgres:16"
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


def test_kafka_is_three_kraft_nodes_with_three_copies_written_to_two(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    assert not any("zookeeper" in name.lower() for name in services)
    voters = "1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"
    ids, cluster_ids = set(), set()
    for name in BROKERS:
        kafka = services[name]
        assert kafka["image"] == "apache/kafka:4.1.1"
        env = kafka["environment"]
        ids.add(env["KAFKA_NODE_ID"])
        cluster_ids.add(env["CLUSTER_ID"])
        assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == voters
        assert env["KAFKA_ADVERTISED_LISTENERS"].startswith(f"PLAINTEXT://{name}:9092"), name
        assert not any("ZOOKEEPER" in key for key in env)
        for key in (
            "KAFKA_DEFAULT_REPLICATION_FACTOR",
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        ):
            assert env[key] == 3, (name, key)
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == 2
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == 2
        assert env["KAFKA_UNCLEAN_LEADER_ELECTION_ENABLE"] == "false"
        assert "healthcheck" in kafka
    assert ids == {1, 2, 3} and len(cluster_ids) == 1


def test_the_projector_runs_on_the_spark_standalone_master(compose: dict[str, Any]) -> None:
    services = compose["services"]
    master = services["spark-master"]
    assert master["entrypoint"] == ["spark-class"]
    assert master["command"][0] == "org.apache.spark.deploy.master.Master"
    assert master["image"] == services["projector"]["image"]  # the image's own pyspark
    slots = []
    for name in SPARK - {"spark-master"}:
        worker = services[name]["command"]
        assert worker[0] == "org.apache.spark.deploy.worker.Worker"
        assert worker[-1] == "spark://spark-master:7077"
        slots.append(int(worker[worker.index("--cores") + 1]))
    projector = services["projector"]
    assert projector["environment"]["LOGFOLD_SPARK_MASTER"] == "spark://spark-master:7077"
    assert "spark-master" in projector["depends_on"]
    # Enough task slots for the real-time queries of the default deployment after losing
    # either worker (as `logfold run --cluster` sizes its own: stack.local.worker_slots).
    from config.settings import Settings
    from stack.local import worker_slots

    assert len(slots) >= 2 and min(slots) >= worker_slots(Settings())


def test_the_balancer_routes_to_both_api_nodes_as_the_local_one_does(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """stack/compose/ holds what stack/local_lb.py renders for the containers (one source for
    both topologies), HAProxy itself accepts it, and it names every API node."""
    from stack.local_lb import COMPOSE_NODES, compose_files

    for path, content in compose_files().items():
        assert path.read_bytes() == content, f"{path} is stale: `python -m stack.local_lb`"
    assert {n.split(":")[0] for n in COMPOSE_NODES} == API_NODES
    lb = compose["services"]["lb"]
    assert lb["volumes"] == ["./stack/compose:/usr/local/etc/haproxy:ro"]
    assert set(lb["depends_on"]) == API_NODES
    config = (ROOT / "stack" / "compose" / "haproxy.cfg").read_text()
    assert "option httpchk GET /health\n" in config
    assert "option httpchk GET /health/live\n" in config
    # HAProxy accepts it (its error page where the container mounts it, here in tmp_path).
    from stack.local_lb import haproxy

    local = tmp_path / "haproxy.cfg"
    local.write_text(config.replace("/usr/local/etc/haproxy/", str(ROOT / "stack/compose") + "/"))
    checked = subprocess.run([haproxy(), "-c", "-f", str(local)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_depends_on_targets_exist_and_gate_on_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for target in _depends_on_targets(service):
            assert target in services, f"{name} depends on unknown service {target!r}"
            assert target != name
    for name in APP_SERVICES:
        deps = services[name]["depends_on"]
        for broker in BROKERS:
            assert deps[broker]["condition"] == "service_healthy", name
        assert deps["postgres"]["condition"] == "service_healthy", name
        if name != "migrate":
            assert deps["migrate"]["condition"] == "service_completed_successfully", name


def test_processor_runs_several_replicas(compose: dict[str, Any]) -> None:
    assert compose["services"]["processor"]["deploy"]["replicas"] >= 2


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for mount in service.get("volumes") or []:
            source = mount.split(":", 1)[0] if isinstance(mount, str) else mount.get("source")
            if source and not source.startswith((".", "/", "~", "$")):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"
    assert {"kafka-1-data", "kafka-2-data", "kafka-3-data", "postgres-data"} <= declared
