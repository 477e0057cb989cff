"""A private network namespace, and a thread in it that runs what it is given, for the
control plane of ``graceful._demo._kube``.

``setns(2)`` is per thread: ``Netns`` keeps one thread inside the namespace, and each call
runs on a thread started from there (so inside too) — a subprocess it starts, another
thread, is inside as well; the rest of the process stays where it is.  A namespace is
named after the process that made it (``gd<pid>n<k>``): a run killed before ``close``
leaves its namespace and what runs in it (a control plane, pods) behind, and the next
process to make one sweeps those of processes that are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, TypeVar

__all__ = ("Netns",)

_CLONE_NEWNET: Final = 0x40000000
_counter = itertools.count()
T = TypeVar("T")


def _setns(fd: int) -> None:
    setns = getattr(os, "setns", None)
    if setns is not None:  # Python 3.12+
        setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


_swept: set[str] = set()


def _sweep_orphans(prefix: str) -> None:
    """Once a process: kill what runs in the namespaces of a process that is gone (a test
    run killed before its ``close``: control planes and pods left running, holding CPU)
    and delete them.  A namespace is named after the process that made it."""
    if prefix in _swept:
        return
    _swept.add(prefix)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{re.escape(prefix)}(\d+)n\d+", name)
        if match is None or _alive(int(match.group(1))):
            continue
        found = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
        )
        for pid in found.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Netns:
    """A private network namespace and a thread inside it that runs what it is given."""

    def __init__(self, prefix: str = "gd") -> None:
        _sweep_orphans(prefix)
        self.name = f"{prefix}{os.getpid()}n{next(_counter)}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        entered: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._main, args=(entered,), name=f"netns-{self.name}", daemon=True
        )
        self._thread.start()
        try:
            entered.result(timeout=10)
        except BaseException:
            self.close()
            raise

    def _main(self, entered: Future[None]) -> None:
        try:
            with open(f"/var/run/netns/{self.name}") as handle:
                _setns(handle.fileno())
        except BaseException as exc:
            entered.set_exception(exc)
            return
        entered.set_result(None)
        # Each call on a thread of its own, started from here (so inside the namespace
        # too): a slow API call or command never holds up the others.
        while (item := self._calls.get()) is not None:
            threading.Thread(target=self._run, args=item, daemon=True).start()

    @staticmethod
    def _run(function: Callable[[], Any], result: Future[Any]) -> None:
        if not result.set_running_or_notify_cancel():
            return
        try:
            result.set_result(function())
        except BaseException as exc:
            result.set_exception(exc)

    def call(self, function: Callable[[], T], *, timeout_s: float = 60.0) -> T:
        """``function()`` on a thread inside the namespace; its result or its exception."""
        result: Future[T] = Future()
        self._calls.put((function, result))
        return result.result(timeout=timeout_s)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command inside the namespace (bounded: 30 s)."""
        return self.call(
            lambda: subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)
        )

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """A process inside the namespace, in a session of its own."""
        return self.call(lambda: subprocess.Popen(args, start_new_session=True, **kwargs))

    def pids(self) -> list[int]:
        found = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False
        )
        return [int(p) for p in found.stdout.split()]

    def close(self) -> None:
        """Kill every process in the namespace (TERM, then KILL after 2 s), delete it."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + 2.0
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        self._calls.put(None)
        self._thread.join(timeout=5)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
