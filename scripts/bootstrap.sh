#!/usr/bin/env bash
# Installs everything Logfold needs on a fresh Debian machine, idempotently:
# Java + Maven + Postgres server binaries + HAProxy (apt, when missing), a virtualenv with the Python
# packages (re-installed when pyproject.toml changes), the Kafka broker jars (Maven), and the class
# archives of Spark's driver and Kafka's broker (stack/class_archive.py).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${LOGFOLD_EXTRAS:-dev}"
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

apt_install() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then sudo="sudo"; else
      echo "error: need root (or sudo) to apt-get install $*" >&2; exit 1
    fi
  fi
  say "installing $* (apt)"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

missing=()
command -v java >/dev/null || missing+=(default-jdk-headless)
command -v mvn >/dev/null || missing+=(maven)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
if command -v python3 >/dev/null; then
  # Debian's python3 comes without venv's pip bootstrap: `python3 -m venv` needs python3-venv.
  python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
else
  missing+=(python3 python3-venv)
fi
# The load balancer in front of the API nodes of `logfold run --cluster` (and its tests).
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null || missing+=(haproxy)
# The test suite drives the live page in headless Chromium (Debian's build and its driver).
if [[ ",$EXTRAS," == *",dev,"* ]]; then
  command -v chromium >/dev/null || missing+=(chromium)
  command -v chromedriver >/dev/null || missing+=(chromium-driver)
  # ...and parses /asyncapi.json with the AsyncAPI project's parser (Node.js).
  command -v npm >/dev/null || missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${EXTRAS//,/_}"
if [ ! -f "$stamp" ]; then
  say "creating the virtualenv (.venv) with the [$EXTRAS] extras"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi

contracts=tests/contracts
lock_stamp="$contracts/node_modules/.installed-$(sha256sum < "$contracts/package-lock.json" | cut -c1-16)"
if [[ ",$EXTRAS," == *",dev,"* && ! -f "$lock_stamp" ]]; then
  say "installing the AsyncAPI parser for the contract tests (npm, in $contracts/node_modules)"
  npm ci --prefix "$contracts" --no-audit --no-fund --loglevel=error
  touch "$lock_stamp"
fi

say "fetching the Kafka broker and Spark Kafka connector jars (Maven Central, cached in .stack/lib)"
.venv/bin/python - <<'PY'
from config.settings import Settings
from stack.local_kafka import ensure_jars
from spark.session import kafka_jars

settings = Settings()
ensure_jars(settings.lib_path)
kafka_jars(settings)
PY
.venv/bin/python - <<'PY'
from config.settings import Settings
from stack import class_archive, local_kafka

settings = Settings()
if not class_archive.archive_path(settings).is_file():
    print("\033[1m==> preparing Spark's class archive (once, about half a minute: every Spark "
          "process then starts seconds sooner)\033[0m", flush=True)
    try:
        class_archive.ensure(settings)
    except Exception as e:  # an optimisation: Spark starts without it, only slower
        print(f"warning: Spark's class archive could not be made, so Spark starts without it: {e}")
if not local_kafka.archive_path(settings.lib_path).is_file():
    print("\033[1m==> preparing Kafka's class archive (once, about 15 s: every broker then starts "
          "seconds sooner)\033[0m", flush=True)
    try:
        class_archive.ensure_kafka(settings.lib_path)
    except Exception as e:  # the same
        print(f"warning: Kafka's class archive could not be made, so brokers start without it: {e}")
PY
say "ready"
