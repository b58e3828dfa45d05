"""CPU time and memory of a process tree, read from Linux's ``/proc`` (no psutil needed).

The parsers are pure functions of a file's text; :func:`cpu_seconds` and :func:`memory` read
the files. A process and all its live descendants are counted together, so a server that forks
workers or a launcher that runs its binary as a child is measured whole; threads are included
by the kernel in their process's figures.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "Memory",
    "Stat",
    "cpu_seconds",
    "descendants",
    "memory",
    "parse_stat",
    "parse_status_kib",
]

_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@attrs.frozen
class Stat:
    """The fields of ``/proc/PID/stat`` this module uses."""

    ppid: int
    utime_ticks: int
    stime_ticks: int


def parse_stat(text: str) -> Stat:
    """Parse ``/proc/PID/stat``.

    The second field is the command name in parentheses and may itself hold spaces and
    parentheses, so the fields are counted from the *last* closing parenthesis.

    Raises:
        ValueError: the text is not a stat line.
    """
    _, paren, rest = text.rpartition(")")
    if not paren:
        raise ValueError("not a /proc/PID/stat line")
    fields = rest.split()
    # After the name: state(3) ppid(4) ... utime(14) stime(15), numbered from 1 in proc(5).
    if len(fields) < 13:
        raise ValueError("truncated /proc/PID/stat line")
    return Stat(ppid=int(fields[1]), utime_ticks=int(fields[11]), stime_ticks=int(fields[12]))


def parse_status_kib(text: str, key: str) -> int | None:
    """A ``kB`` value of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``...), or ``None``."""
    prefix = key + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            parts = line[len(prefix) :].split()
            return int(parts[0]) if parts else None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None  # the process ended between listing and reading


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        text = _read(entry / "stat")
        if text is None:
            continue
        try:
            stat = parse_stat(text)
        except ValueError:
            continue
        children.setdefault(stat.ppid, []).append(int(entry.name))
    tree = [pid]
    for parent in tree:  # grows while iterating: a breadth-first walk
        tree.extend(children.get(parent, ()))
    return tree


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` and its live descendants so far."""
    ticks = 0
    for member in descendants(pid):
        text = _read(_PROC / str(member) / "stat")
        if text is not None:
            stat = parse_stat(text)
            ticks += stat.utime_ticks + stat.stime_ticks
    return ticks / _TICKS_PER_S


@attrs.frozen
class Memory:
    """Resident memory of a process tree: now (``VmRSS``) and at its peak (``VmHWM``)."""

    rss_bytes: int
    peak_rss_bytes: int


def memory(pid: int) -> Memory:
    """Resident set of ``pid`` and its live descendants (peaks summed per process)."""
    rss = peak = 0
    for member in descendants(pid):
        text = _read(_PROC / str(member) / "status")
        if text is None:
            continue
        rss += (parse_status_kib(text, "VmRSS") or 0) * 1024
        peak += (parse_status_kib(text, "VmHWM") or 0) * 1024
    return Memory(rss_bytes=rss, peak_rss_bytes=peak)


def environment(packages: tuple[str, ...]) -> dict[str, Any]:
    """The machine a benchmark ran on: CPU cores, Python, platform and package versions."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 0
    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu_cores": cores,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
    }
