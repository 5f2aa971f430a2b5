"""This process's resident memory (RSS), as refit reports and benchmarks measure it.

Three figures, each with one function and one report key, so that a key read anywhere in the
project (a worker's refit report, a vLLM rank's, a benchmark's record) means one thing:

* :func:`rss_bytes`, key ``rss_bytes``: resident now (``VmRSS``). Keys that name a moment
  (``rss_before_bytes``, ``rss_base_bytes``) are this figure taken then.
* :func:`lifetime_peak_rss_bytes`, key ``lifetime_peak_rss_bytes``: the highest RSS since the
  process started.
* :func:`peak_rss_bytes`, key ``peak_rss_bytes``: the highest RSS since the last
  :func:`reset_peak_rss` in this process; a report that resets at the start of a call gives
  that call's own peak under it. (The benchmarks' records name the same figure
  ``rss_peak_bytes``, as their results files always have.)

Linux keeps one high-water mark per process (``VmHWM`` in ``/proc/self/status``); writing ``5``
to ``/proc/self/clear_refs`` (Linux >= 4.0) resets it to the current RSS. The mark is shared
by everything in the process: a reset by any user of this module starts a new window for all
of them, so peaks since a reset are for processes that measure one call at a time (a vLLM
worker, a benchmark's worker). The lifetime peak survives resets made here (each one first
folds the mark into it); one made by writing ``clear_refs`` directly would lower it.
``getrusage``'s ``ru_maxrss`` is no lifetime peak after any reset: Linux reports the mark
there too. All figures count the pages the process has resident (anonymous, file-backed and
shared memory), as exactly as the kernel's batched page counters do (to a few hundred KiB).
Only :func:`lifetime_peak_rss_bytes` has a value off Linux (from ``ru_maxrss``); the others
are ``None`` there.

Imports nothing of ckpt-core and nothing heavy: integrations and benchmarks import it beside
the consumer's contract.
"""

from __future__ import annotations

import resource
import sys
import threading

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_PEAK = "5"  # clear_refs: reset the peak RSS to the current RSS, nothing else

_lock = threading.Lock()
_peak_before_reset = 0  # the highest mark a reset made here has cleared, in bytes
_window_open = False  # whether the last reset made here succeeded


def _status_bytes(field: str) -> int | None:
    """``field`` of ``/proc/self/status`` (reported in KiB) in bytes; ``None`` off Linux."""
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """This process's resident set size now (``VmRSS``); ``None`` off Linux."""
    return _status_bytes("VmRSS")


def lifetime_peak_rss_bytes() -> int:
    """The highest resident set size this process has had since it started: the kernel's mark
    and every mark a :func:`reset_peak_rss` cleared. Off Linux, ``getrusage``'s
    ``ru_maxrss`` (no reset exists there to lower it)."""
    mark = _status_bytes("VmHWM")
    if mark is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, the rest KiB
    with _lock:
        return max(_peak_before_reset, mark)


def reset_peak_rss() -> bool:
    """Start a new peak window at the current RSS: :func:`peak_rss_bytes` then reports the
    highest RSS from here on (the lifetime peak keeps what came before). ``False`` where the
    kernel refuses (off Linux, before Linux 4.0); :func:`peak_rss_bytes` is then ``None``
    until a reset succeeds."""
    global _peak_before_reset, _window_open
    with _lock:
        mark = _status_bytes("VmHWM")
        if mark is not None:
            _peak_before_reset = max(_peak_before_reset, mark)
        try:
            with open(_CLEAR_REFS, "w") as clear_refs:
                clear_refs.write(_RESET_PEAK)
        except OSError:
            _window_open = False
            return False
        _window_open = True
        return True


def peak_rss_bytes() -> int | None:
    """The highest resident set size since the last :func:`reset_peak_rss` in this process
    (``VmHWM`` after the reset); ``None`` when none succeeded, for then the kernel's mark is
    not a peak since any moment this process chose."""
    with _lock:
        return _status_bytes("VmHWM") if _window_open else None
