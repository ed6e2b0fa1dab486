"""Events: the envelope, the event types of each aggregate, serialization and upcasting.

Domain modules here import only the standard library; the Kafka event store lives in
`events.store` and is the only module that talks to Kafka.
"""
