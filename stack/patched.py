"""`python -m stack.patched <logfold arguments>`: the `logfold` command in a process that gevent
patched before anything else was imported. `logfold api` with `LOGFOLD_API_WORKER=gevent`
starts itself again this way: kafka-python and psycopg choose how they wait when first
imported, and must choose gevent's (stack/serve.py checks that they did)."""

from gevent import monkey

monkey.patch_all()

from stack.cli import main  # noqa: E402

main()
