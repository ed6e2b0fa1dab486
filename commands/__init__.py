"""The write model: one module per aggregate with pure `decide` and `evolve`, the command
schemas at the HTTP/Kafka boundary, the registry that wires them, and command processing."""
