"""Spark jobs: the streaming projector (the events query and the joins query), the rebuild."""
