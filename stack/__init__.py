"""Running Logfold: settings, topics, the local Kafka and Postgres, the CLI and wiring."""
