"""Per-call peak resident memory of this process, on Linux.

``ru_maxrss`` is a process-lifetime peak, useless in worker processes reused across cases. Linux
lets a process reset its own high-water mark (writing ``5`` to ``/proc/self/clear_refs``, since
Linux 4.0); ``VmHWM`` in ``/proc/self/status`` then reports the peak since that reset. Both
figures count anonymous, file-backed and shared-memory pages the process has touched.
"""

from __future__ import annotations

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field} line: peak memory needs Linux")


def current_rss_bytes() -> int:
    """Resident set size now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the last :func:`reset_peak_rss` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS; ``False`` where the kernel refuses, in
    which case :func:`peak_rss_bytes` stays a process-lifetime peak."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True
