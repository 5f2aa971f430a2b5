"""Local workers forked from a zygote: a process that imported torch once.

A fresh interpreter spends ~3 s of CPU importing torch; a pool of N workers started as
``python -m ckpt_core.orchestration.worker_main`` pays that N times, and a test suite that starts
hundreds of workers pays minutes. A worker forked from a zygote starts in milliseconds and is
otherwise the process ``python -m`` would have made:

- The zygote was started with the worker's environment, as far as Python's start-up and torch's
  import read it: variables named ``PYTHON*``, ``LD_*``, ``TORCH*``, ``PYTORCH*``, ``CUDA*``,
  ``NVIDIA*``, ``TRITON*``, ``OMP_*``, ``KMP_*``, ``GOMP_*``, ``MKL_*`` and ``OPENBLAS_*``
  (:func:`zygote_key`). One zygote runs per distinct set of those; ``OMP_NUM_THREADS`` is the
  exception, applied by the worker itself with ``torch.set_num_threads``.
- The worker's ``os.environ`` is exactly the environment it was given.
- The zygote imports torch and nothing of ckpt_core or of any service, unless its owner named
  modules to *preload* (``LocalProcessPool(preload=...)``, one zygote per distinct list):
  libraries every worker of that pool imports, such as ``transformers`` (~4 s each). A
  preloaded module that starts a thread ends the zygote with an error. The worker runs
  ``ckpt_core.orchestration.worker_main`` as ``python -m`` does (``runpy``), from its own
  ``sys.path``: its working directory first, then ``PYTHONPATH``. So a tree put first on
  ``PYTHONPATH`` (``benchmarks.against``) is the one the worker runs.
- Its standard output and error are the owner's at the time of the start; its input is
  ``/dev/null``.
- The zygote never runs a torch operation or starts a thread: the fork copies one thread and
  no thread pool.

Protocol, over a Unix ``SOCK_SEQPACKET`` socket pair: the owner sends ``{"cwd", "env"}`` with five
file descriptors (requests, replies, status, stdout, stderr); the zygote forks, answers the
child's pid (8 bytes), and when the child exits writes its exit code to the status pipe as
ASCII digits (as ``subprocess`` reports it: negative for a signal) and closes it. The zygote
exits when the owner's end of the socket closes; its workers keep running until their input
closes.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

_IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NVIDIA",
    "TRITON",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
)
_PER_WORKER = frozenset({"OMP_NUM_THREADS"})
_PID = struct.Struct("!q")
_WORKER_MAIN = "ckpt_core.orchestration.worker_main"
_MAX_REQUEST_BYTES = 1 << 20  # a working directory and an environment


def available() -> bool:
    """Whether workers can be forked from a zygote here (Linux: ``os.pidfd_open``)."""
    return hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


def zygote_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` that a zygote must have been started with to fork its worker."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _PER_WORKER))


class ZygoteProcess:
    """A forked worker, as much of ``subprocess.Popen`` as ``LocalProcessPool`` uses: ``pid``,
    ``send_signal``, ``kill`` and ``wait`` (its exit code, from the zygote's status pipe)."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status_fd = status_fd

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the worker ended; ``subprocess.TimeoutExpired`` past ``timeout``.
        ``ChildProcessError`` if the code was lost: the zygote ended before the worker."""
        if self.returncode is not None:
            return self.returncode
        with selectors.DefaultSelector() as selector:
            selector.register(self._status_fd, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        text = os.read(self._status_fd, 64)  # one write of a few bytes: it arrives whole
        os.close(self._status_fd)
        self._status_fd = -1
        if not text.strip().lstrip(b"-").isdigit():
            raise ChildProcessError(f"the exit code of worker {self.pid} was lost: its zygote ended first")
        self.returncode = int(text)
        return self.returncode


class Zygote:
    """One zygote process, started with ``env``, that imported torch and ``preload``;
    :meth:`fork` starts a worker from it."""

    def __init__(self, env: Mapping[str, str], start_timeout_s: float, preload: tuple[str, ...] = ()) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self._start_timeout_s = start_timeout_s
        self._broken = False  # a request went unanswered: a late answer would answer the next
        self._preload = preload
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno()), *preload],
                pass_fds=(theirs.fileno(),),
                env=dict(env),
                stdin=subprocess.DEVNULL,
            )

    def alive(self) -> bool:
        return not self._broken and self.process.poll() is None

    def fork(self, requests_fd: int, replies_fd: int, cwd: str, env: Mapping[str, str]) -> ZygoteProcess:
        """A worker reading ``requests_fd`` and writing ``replies_fd`` (the caller closes its
        copies), in ``cwd`` with ``env``. ``RuntimeError`` if the zygote does not answer in time."""
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                # The first fork waits for the zygote's torch import: the start deadline covers it.
                self._socket.settimeout(self._start_timeout_s)
                request = json.dumps({"cwd": cwd, "env": dict(env)}).encode()
                socket.send_fds(self._socket, [request], [requests_fd, replies_fd, status_w, 1, 2])
                reply = self._socket.recv(_PID.size)
        except (OSError, ValueError) as exc:
            self._broken = True
            os.close(status_r)
            raise RuntimeError(f"{self._name()} did not start a worker: {exc}") from exc
        finally:
            os.close(status_w)
        if len(reply) != _PID.size:
            self._broken = True
            os.close(status_r)
            raise RuntimeError(f"{self._name()} ended with status {self.process.poll()}")
        return ZygoteProcess(_PID.unpack(reply)[0], status_r)

    def _name(self) -> str:
        preloading = f", preloading {', '.join(self._preload)} (its error is above)" if self._preload else ""
        return f"the worker zygote (pid {self.process.pid}{preloading})"

    def close(self) -> None:
        """End the zygote (its workers run on); reap it."""
        self._socket.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_zygotes: dict[tuple[tuple[tuple[str, str], ...], tuple[str, ...]], Zygote] = {}
_zygotes_lock = threading.Lock()
_owner_pid = os.getpid()


def fork_worker(
    env: Mapping[str, str], requests_fd: int, replies_fd: int, start_timeout_s: float, preload: tuple[str, ...] = ()
) -> ZygoteProcess:
    """Start a worker of ``python -m ckpt_core.orchestration.worker_main`` with ``env``, forked
    from this process's zygote for ``env`` and ``preload`` (started on first use, again if it
    ended)."""
    global _owner_pid
    key = (zygote_key(env), preload)
    with _zygotes_lock:
        if os.getpid() != _owner_pid:  # a forked owner: the parent's zygotes are not ours to use
            _zygotes.clear()
            _owner_pid = os.getpid()
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive():
            if zygote is not None:
                zygote.close()
            zygote = _zygotes[key] = Zygote(env, start_timeout_s, preload)
    return zygote.fork(requests_fd, replies_fd, os.getcwd(), env)


@atexit.register
def _close_zygotes() -> None:
    with _zygotes_lock:
        zygotes = list(_zygotes.values()) if os.getpid() == _owner_pid else []
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()


def _serve(control: socket.socket) -> None:
    """The zygote's loop: fork a worker per request, report each one's exit code."""
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status fd)
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not control:
                    pid, status_fd = children.pop(key.fd)
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    _, status = os.waitpid(pid, 0)
                    with contextlib.suppress(OSError):  # an owner that stopped listening
                        os.write(status_fd, str(os.waitstatus_to_exitcode(status)).encode())
                    os.close(status_fd)
                    continue
                try:
                    message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST_BYTES, 5)
                except ConnectionResetError:
                    message, fds = b"", []
                if not message:  # the owner closed its end, or exited
                    return
                requests_fd, replies_fd, status_fd, stdout_fd, stderr_fd = fds
                pid = os.fork()
                if pid == 0:
                    # Only this worker's descriptors go on: a sibling's status pipe held open
                    # here would hide that sibling's exit from its owner.
                    control.close()
                    selector.close()
                    for pidfd, (_, sibling_status_fd) in children.items():
                        os.close(pidfd)
                        os.close(sibling_status_fd)
                    os.close(status_fd)
                    _become_worker(json.loads(message), requests_fd, replies_fd, stdout_fd, stderr_fd)
                for fd in (requests_fd, replies_fd, stdout_fd, stderr_fd):
                    os.close(fd)
                pidfd = os.pidfd_open(pid)  # a child that already ended stays a zombie until reaped
                children[pidfd] = (pid, status_fd)
                selector.register(pidfd, selectors.EVENT_READ)
                control.sendall(_PID.pack(pid))


def _become_worker(request: dict[str, Any], requests_fd: int, replies_fd: int, stdout_fd: int, stderr_fd: int) -> None:
    """In the forked child: take the owner's output streams, working directory and
    ``sys.path[0]`` (what ``python -m`` puts first), then run the worker. Never returns."""
    code = 1
    try:
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        os.close(stdout_fd)
        os.close(stderr_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        import runpy

        sys.argv = [_WORKER_MAIN, str(requests_fd), str(replies_fd)]
        runpy.run_module(_WORKER_MAIN, run_name="__main__", alter_sys=True)
        code = 0
    except BaseException:  # noqa: BLE001 - a worker that cannot start must say why, then end
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(control_fd: int, preload: list[str]) -> None:
    import torch  # noqa: F401 - the import every worker would otherwise pay for

    for name in preload:
        importlib.import_module(name)
    if threading.active_count() > 1:  # a fork copies only this thread: the others' locks stay held
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        sys.exit(f"ckpt-core worker zygote: preloading {', '.join(preload)} started threads ({names}); preload less")
    _serve(socket.socket(fileno=control_fd))


if __name__ == "__main__":
    # Run as a file, Python put this file's folder first on sys.path: ``python -m`` puts the
    # working directory there, and so does each worker.
    sys.path[0] = os.getcwd()
    _main(int(sys.argv[1]), sys.argv[2:])
