# One image for every Logfold process (API, command processor, Spark projector, CDC, migrations).
# The service to run is the argument: `docker run logfold:local api --host 0.0.0.0 --port 8000`.
# See docker-compose.yml for the multi-container layout.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Java for Spark (pyspark starts a JVM); procps because Spark's launch scripts call `ps`;
# Maven to fetch Spark's Kafka connector at build time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends default-jre-headless procps maven \
    && rm -rf /var/lib/apt/lists/*

ENV LOGFOLD_HOME=/opt/logfold

WORKDIR /src
COPY . .
RUN pip install "." \
    && python -c "from spark.session import kafka_jars; from config.settings import Settings; kafka_jars(Settings())" \
    && rm -rf /src /root/.m2

# Unprivileged runtime user; /var/lib/logfold holds local state (e.g. Spark checkpoints).
RUN groupadd --system --gid 10001 logfold \
    && useradd --system --uid 10001 --gid logfold --create-home --home-dir /home/logfold logfold \
    && mkdir -p /var/lib/logfold \
    && chown logfold:logfold /var/lib/logfold

USER logfold
WORKDIR /var/lib/logfold

EXPOSE 8000
ENTRYPOINT ["logfold"]
CMD ["--help"]
