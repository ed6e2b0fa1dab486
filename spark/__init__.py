"""Spark jobs: the streaming projector, the rebuild, and (later) the join job."""
