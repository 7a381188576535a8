"""Operator tools: a lock-free snapshot of a namespace (snapshot.py), `shmcache-inspect`
(inspect.py), Prometheus metrics (metrics.py), the `shmcache` command (cli.py) and its demo."""
