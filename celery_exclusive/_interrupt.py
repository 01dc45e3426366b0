"""``lock_on_lost="terminate"``: interrupt a task body whose lease was lost.

Moved out of :mod:`celery_exclusive.task` unchanged; the task arms an :class:`Interrupter`
around its body and turns :class:`LeaseLostInterrupt` into :class:`~celery_exclusive.LockLost`.
"""

from __future__ import annotations

import ctypes
import threading

from celery_exclusive.lease import Lease


class LeaseLostInterrupt(BaseException):
    """Raised inside a task whose lease was lost under ``lock_on_lost="terminate"``.

    A BaseException, like KeyboardInterrupt, so a task's ``except Exception`` cannot
    swallow it; the task's caller sees :class:`LockLost` instead.
    """


class Interrupter:
    """Raises LeaseLostInterrupt in one thread, only while armed (the task body runs).

    CPython delivers it at the thread's next bytecode: pure-Python work stops at once, a
    blocking C call (a socket read, ``time.sleep``) first runs to its end.
    """

    def __init__(self, thread_id: int) -> None:
        self._thread_id = thread_id
        self._mutex = threading.Lock()
        self._armed = True
        self._fired = False

    def fire(self, lease: Lease, reason: str) -> None:
        with self._mutex:
            if self._armed:
                self._armed = False
                self._fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread_id), ctypes.py_object(LeaseLostInterrupt)
                )

    def disarm(self) -> None:
        """Called in the task's thread when the body ends; raises if the lease was lost.

        An interrupt sent but not yet delivered is cancelled and raised here instead, so it
        can never surface later in unrelated code.
        """
        with self._mutex:
            fired = self._fired
            self._armed = False
        if fired:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)
            raise LeaseLostInterrupt


def arm(*leases: Lease) -> Interrupter:
    """An interrupter for the calling thread, fired when any of ``leases`` is lost."""
    interrupter = Interrupter(threading.get_ident())
    for lease in leases:
        lease.on_lost(interrupter.fire)
    return interrupter
