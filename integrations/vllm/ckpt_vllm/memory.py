"""This process's resident memory, read from ``/proc`` (Linux), for refit reports."""

from __future__ import annotations


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (``VmHWM``) at the current RSS; False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak RSS since the process started or since the last :func:`reset_peak_rss`."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024
