"""A small example app for celery-exclusive, and the driver behind ``scripts/demo``.

* :mod:`example_worker.app`     the Celery app, configured from ``EXAMPLE_*`` environment variables
* :mod:`example_worker.tasks`   the tasks: one per lock idiom (skip, beat, retry, rerun, start-up job)
* :mod:`example_worker.records` the append-only JSON-lines file every run is recorded in
* :mod:`example_worker.broker`  kombu's filesystem transport with atomic writes (the no-server broker)
* :mod:`example_worker.demo`    starts workers and beat, enqueues contending work, checks the records

Importing this package imports nothing else: the app is configured when ``app`` is imported.
"""
