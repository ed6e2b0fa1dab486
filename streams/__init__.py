"""Streams of facts: records that need no decision against an aggregate (page views, clicks,
sensor readings), ingested as they are and analysed by event time. One module per stream
declares its record; `streams/registry.py` lists them."""
