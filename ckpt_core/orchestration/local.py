"""``LocalProcessPool``: worker services in local subprocesses, called in parallel with deadlines.

Each worker is a Python process running ``python -m ckpt_core.orchestration.worker_main``, talking
JSON lines over two pipes: forked from a zygote that imported torch once
(``start_method="forkserver"``, the default on Linux; see :mod:`~ckpt_core.orchestration.zygote`),
or a fresh interpreter (``"spawn"``). Calls to several workers run concurrently (a refit needs senders
and receivers at once); every call has a deadline, and a worker that dies is reported with
its exit status instead of being waited for.

Like ``torchrun``, the pool gives each worker an equal share of the machine's cores for
torch's intra-op threads (``OMP_NUM_THREADS``, unless the caller's environment sets it):
several processes each running a thread pool over every core oversubscribe the machine, and
a copy split over busy cores runs slower than on one.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ckpt_core.errors import InvalidArgumentError
from ckpt_core.orchestration import zygote
from ckpt_core.orchestration.coordinator import CallResult
from ckpt_core.orchestration.protocol import MAX_LINE_BYTES, decode, encode

START_METHODS = ("forkserver", "spawn")


class _Worker:
    def __init__(
        self, label: str, env: dict[str, str], start_method: str, start_timeout_s: float, preload: tuple[str, ...]
    ) -> None:
        self.label = label
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        try:
            self.process: subprocess.Popen[bytes] | zygote.ZygoteProcess
            if start_method == "forkserver":
                self.process = zygote.fork_worker(env, to_child_r, from_child_w, start_timeout_s, preload)
            else:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "ckpt_core.orchestration.worker_main", str(to_child_r), str(from_child_w)],
                    pass_fds=(to_child_r, from_child_w),
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
        except BaseException:
            os.close(self._to_child)
            os.close(self._from_child)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._buffer = b""

    @property
    def reader(self) -> int:
        return self._from_child

    def send(self, method: str, kwargs: dict[str, Any]) -> None:
        os.write(self._to_child, encode({"method": method, "kwargs": kwargs}))

    def read_available(self) -> dict[str, Any] | None:
        """Read what the pipe holds; the reply once a whole line arrived. EOF raises."""
        chunk = os.read(self._from_child, 1 << 20)
        if not chunk:
            raise EOFError
        self._buffer += chunk
        if len(self._buffer) > MAX_LINE_BYTES:
            raise ValueError(f"{self.label} sent a reply larger than {MAX_LINE_BYTES} bytes")
        if b"\n" not in self._buffer:
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return decode(line)

    def exit_description(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        except ChildProcessError as exc:
            return f"ended ({exc})"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def end_input(self) -> None:
        """Close the request pipe: the worker exits at end of input."""
        if self._to_child >= 0:
            os.close(self._to_child)
            self._to_child = -1

    def close(self, timeout_s: float = 10.0) -> None:
        """End the worker's input, then reap the process (killing it past ``timeout_s``)."""
        self.end_input()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            with contextlib.suppress(ChildProcessError):
                self.process.wait()
        except ChildProcessError:
            pass  # ended, its exit code lost with its zygote: nothing left to reap
        os.close(self._from_child)


class LocalProcessPool:
    """Runs one service object per local process; ``call`` reaches several of them at once.

    ``services[i]`` is ``{"service": "module:Class", **constructor kwargs}``; ``labels[i]``
    names worker ``i`` in errors (for example ``"rollout rank 1"``). ``env`` is the workers'
    environment (default: ours). ``start_method`` is ``"forkserver"`` (forked from a zygote
    that imported torch: milliseconds per worker instead of seconds; the default where
    :func:`~ckpt_core.orchestration.zygote.available`) or ``"spawn"`` (a fresh interpreter).
    ``preload`` names modules the zygote imports once for every worker of the pool, beside
    torch (for example ``"transformers"``): only libraries, since a worker then runs the
    zygote's copy, and only ones that start no thread at import (the zygote refuses those).
    ``"spawn"`` workers import what they need themselves, so there it changes nothing.
    """

    def __init__(
        self,
        services: Sequence[dict[str, Any]],
        *,
        labels: Sequence[str] | None = None,
        start_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        start_method: str | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        start_method = start_method or ("forkserver" if zygote.available() else "spawn")
        if start_method not in START_METHODS or (start_method == "forkserver" and not zygote.available()):
            raise InvalidArgumentError(
                f"start_method must be one of {START_METHODS} ('forkserver' on Linux only), got {start_method!r}"
            )
        if isinstance(preload, str) or not all(
            isinstance(name, str) and all(part.isidentifier() for part in name.split(".")) for name in preload
        ):
            raise InvalidArgumentError(
                f"preload must be a list of module names such as 'transformers', got {preload!r}"
            )
        labels = list(labels) if labels is not None else [f"worker {i}" for i in range(len(services))]
        env = _with_thread_share(env, len(labels))
        self._services = [dict(spec) for spec in services]
        self._start_timeout_s = start_timeout_s
        self._start = (env, start_method, start_timeout_s, tuple(preload))  # _Worker's arguments after its label
        self._workers: list[_Worker] = []
        try:
            for label in labels:
                self._workers.append(_Worker(label, *self._start))
            results = self.call([(i, "__init__", dict(spec)) for i, spec in enumerate(services)], start_timeout_s)
            failed = [r for r in results if not r.ok]
            if failed:
                raise RuntimeError("starting workers failed:\n" + "\n".join(r.describe() for r in failed))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._workers)

    def pid(self, index: int) -> int:
        return self._workers[index].process.pid

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``index`` (tests use it to simulate a crashed peer)."""
        self._workers[index].process.send_signal(sig)

    def restart(self, index: int) -> None:
        """Replace worker ``index`` with a fresh process running a new instance of its service
        (what a supervisor does after a crash): the old process is stopped (killed, if it still
        runs) and reaped first. ``RuntimeError`` if the new one does not start."""
        old = self._workers[index]
        old.process.kill()
        old.close()
        self._workers[index] = _Worker(old.label, *self._start)
        (started,) = self.call([(index, "__init__", dict(self._services[index]))], self._start_timeout_s)
        if not started.ok:
            raise RuntimeError(f"restarting {old.label} failed:\n{started.describe()}")

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        """Call ``method(**kwargs)`` on each listed worker concurrently; one result per call.

        A call that has not answered within ``timeout_s`` (from now) fails with a timeout and its
        worker is killed; a worker that dies fails its call at once with its exit status.
        """
        pending: dict[int, int] = {}
        results: list[CallResult | None] = [None] * len(calls)
        for position, (index, method, kwargs) in enumerate(calls):
            worker = self._workers[index]
            try:
                worker.send(method, kwargs)
                pending[worker.reader] = position
            except OSError:
                results[position] = CallResult.failure(
                    worker.label, "WorkerExited", f"{worker.label} {worker.exit_description()}"
                )
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            for fd in pending:
                selector.register(fd, selectors.EVENT_READ)
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, _ in selector.select(timeout=remaining):
                    position = pending[key.fd]
                    worker = self._workers[calls[position][0]]
                    try:
                        reply = worker.read_available()
                    except (EOFError, OSError):
                        reply = {
                            "ok": False,
                            "error_type": "WorkerExited",
                            "message": f"{worker.label} {worker.exit_description()}",
                        }
                    except ValueError as exc:  # a reply that is not protocol JSON
                        worker.process.kill()
                        reply = {
                            "ok": False,
                            "error_type": "ProtocolError",
                            "message": f"{worker.label} sent a malformed reply and was stopped: {exc}",
                        }
                    if reply is None:
                        continue
                    results[position] = CallResult.from_reply(worker.label, reply)
                    selector.unregister(key.fd)
                    del pending[key.fd]
        for position in pending.values():
            worker = self._workers[calls[position][0]]
            # A worker past its deadline is stopped: its late reply would answer the next call.
            worker.process.kill()
            results[position] = CallResult.failure(
                worker.label,
                "TimeoutError",
                f"{worker.label} did not answer {calls[position][1]}() within {timeout_s:g}s and was stopped",
            )
        return [r for r in results if r is not None]

    def close(self) -> None:
        """End every worker's input, then reap it (killing any that does not stop)."""
        workers, self._workers = self._workers, []
        for worker in workers:  # all at once: each then exits while the others are reaped
            worker.end_input()
        for worker in workers:
            worker.close()

    def __enter__(self) -> LocalProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_thread_share(env: dict[str, str] | None, workers: int) -> dict[str, str]:
    """``env`` (default: ours) with ``OMP_NUM_THREADS`` set to this worker's share of the cores,
    unless it is set already."""
    env = dict(os.environ if env is None else env)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    return env
