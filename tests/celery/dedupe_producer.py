"""A producer process for tests/celery/test_dedupe.py: sends deduplicated tasks, prints their ids.

``python -m tests.celery.dedupe_producer '<json>'`` with the spec's fields: ``task`` (a task
name in tests/celery/app.py), ``args``, ``options`` (apply_async's), ``calls`` (how many
sends, each from its own thread), ``start_at`` (wall time to start sending at, so that
several producers send at once) and ``kill_before_publish`` (SIGKILL this process when the
first send, holding its marker, is about to publish), ``revoke`` (then revoke every id sent
with ``AsyncResult.revoke()``, appending ``{"revoke_seconds": ...}``, the time that took)
and ``then_send`` (then send once more, appending its answer), ``link`` / ``link_error``
(``[task name, args]``: each send's callback, that task's ``si(*args)``) and
``capture_log`` (then append ``{"warnings": [...]}``, the WARNING messages the
``celery_exclusive.dedupe`` logger gave during the spec). Prints one JSON list, one
entry per send: ``{"id": ...}`` or ``{"error": class name, "task_id": ...}``.

``python -m tests.celery.dedupe_producer --serve`` answers specs read from stdin, one JSON
line each, with one JSON line each, until stdin closes: a producer started once per store
and module, so that tests do not wait for a new interpreter's start-up at every send (the
specs that kill or reconfigure the process still get a process of their own). A spec's
``revoke_ids`` (a list of ids, no sends) are revoked with ``AsyncResult.revoke()``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from celery.app.task import Task

from tests.celery import app as tasks


def answer(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one spec; its answers."""
    if "revoke_ids" in spec:
        began = time.monotonic()
        for task_id in spec["revoke_ids"]:
            tasks.app.AsyncResult(task_id).revoke()
        return [{"revoke_seconds": time.monotonic() - began}]
    task = getattr(tasks, spec["task"])
    spec = {**spec, "options": dict(spec.get("options", {}))}
    for name in ("link", "link_error"):
        if name in spec:
            callback, callback_args = spec[name]
            spec["options"][name] = getattr(tasks, callback).si(*callback_args)
    captured = _Captured() if spec.get("capture_log") else None
    if spec.get("kill_before_publish"):

        def die(*_: Any, **__: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        Task.apply_async = die  # type: ignore[method-assign]  # ExclusiveTask's super() finds it
    answers: list[dict[str, Any]] = [{} for _ in range(spec.get("calls", 1))]

    def send(index: int) -> None:
        delay = spec.get("start_at", 0) - time.time()
        if delay > 0:
            time.sleep(delay)
        answers[index] = _send(task, spec)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(answers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if spec.get("revoke"):
        began = time.monotonic()
        for sent in list(answers):
            if "id" in sent:
                task.AsyncResult(sent["id"]).revoke()
        answers.append({"revoke_seconds": time.monotonic() - began})
    if spec.get("then_send"):
        answers.append(_send(task, spec))
    if captured is not None:
        answers.append({"warnings": captured.close()})
    return answers


class _Captured(logging.Handler):
    """The WARNING messages of the ``celery_exclusive.dedupe`` logger until :meth:`close`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._logger = logging.getLogger("celery_exclusive.dedupe")
        self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def close(self) -> list[str]:  # type: ignore[override]
        self._logger.removeHandler(self)
        super().close()
        return self.messages


def serve() -> None:
    """Answer each spec line of stdin with one JSON line on stdout."""
    while line := sys.stdin.readline():
        print(json.dumps(answer(json.loads(line))), flush=True)


def _send(task: Any, spec: dict[str, Any]) -> dict[str, Any]:
    try:
        result = task.apply_async(tuple(spec.get("args", ())), {}, **spec.get("options", {}))
    except Exception as exc:
        traceback.print_exc()
        return {"error": type(exc).__name__, "task_id": getattr(exc, "task_id", None)}
    return {"id": result.id}


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        print(json.dumps(answer(json.loads(sys.argv[1]))))
