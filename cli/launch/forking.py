"""Processes of ``wafl run`` forked from the launcher instead of started afresh.

A fresh Python process that imports torch pays about 0.3 GB of private memory (the libraries'
relocated data, the interpreter's modules) and seconds of CPU before it does anything. The launcher
imports torch and the server's and clients' modules once (:func:`preload`), then forks each process
of the run from itself (:func:`fork_main`): the children share those pages copy-on-write with the
launcher and with each other, and start at once. Each child is what ``python -m wafl.cli.main ARGS``
would be: its own process group, its log file as stdout and stderr, the launcher's environment plus
the extra variables, default signal handlers, exit status from the entry point the launcher is given
(:func:`wafl.cli.main.main`, passed down by the command: this room imports nothing above it).

Forking is only safe from a process that has no other threads and has not started gRPC: both are
checked by :func:`can_fork` before anything is preloaded, so ``launch`` falls back to starting
processes afresh when it is called from, say, a test process that used gRPC already.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

# what the server, the workers and the clients import: loaded once in the launcher, shared by its children
PRELOAD = ("torch", "wafl.server.app", "wafl.client.worker", "wafl.client.app", "wafl.common.datasets")


def can_fork() -> bool:
    """True where this process may fork the run's processes: POSIX, one thread, gRPC never imported."""
    return hasattr(os, "fork") and threading.active_count() == 1 and "grpc" not in sys.modules


def preload() -> None:
    """Imports what the run's processes import (:data:`PRELOAD`) and pays torch's lazy imports (its first
    optimizer step imports ``torch._dynamo``: seconds of CPU), so that forked children share all of it."""
    for name in PRELOAD:
        importlib.import_module(name)
    from wafl.client.startup import warm_up_torch  # torch and gRPC: after can_fork said yes, never at import

    warm_up_torch()


class ForkedProcess:
    """A forked child as ``launch`` uses a :class:`subprocess.Popen`: ``pid``, ``returncode``, ``poll``,
    ``wait``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_main(
    argv: Sequence[str],
    log: Path,
    env: dict[str, str] | None,
    main: Callable[[list[str]], int],
    *,
    prepare: Callable[[], None] | None = None,
    append: bool = False,
) -> ForkedProcess:
    """Forks a child that runs ``main(argv)`` (``wafl.cli.main.main``) with ``log`` as its stdout and stderr
    (``append``: after what the file holds). ``env``: the child's whole environment (None: this process's);
    ``prepare``: called in the child just before ``main`` (to enter a network namespace, say)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    pid = os.fork()
    if pid:
        os.close(fd)
        try:  # also from here (the child does it too): its group exists before the launcher signals it
            os.setpgid(pid, pid)
        except OSError:  # the child got there first, or already exited
            pass
        return ForkedProcess(pid, argv)
    code = 1
    try:  # the child: never returns into the launcher's code
        os.setpgid(0, 0)  # its own process group, as Popen(process_group=0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(null)
        os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the child's own streams, on its new descriptors
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if prepare is not None:
            prepare()
        sys.argv = ["wafl", *argv]
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    # BaseException: a forked child never unwinds into the parent's code (KeyboardInterrupt included); what
    # it raised is in its log and its exit status says it failed
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
