"""Webhooks: every change of a view that concerns an endpoint, POSTed to its URL in order per
key, at least once, signed as Standard Webhooks prescribes (docs/webhooks.md).

An adapter, like `cdc/`: pure parts (`signing`, `backoff`, `addresses`, `messages`), the
outbound HTTP client that enforces the address policy at connect time (`outbound`), the
endpoints' Postgres store with their durable cursors and dead letters (`tables`, `store`), and
the dispatcher process, one worker per endpoint (`dispatcher`, `worker`)."""
