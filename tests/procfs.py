"""What /proc says about a process: resident memory and mapped shared memory."""

from __future__ import annotations

import itertools
import statistics


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def steady_growth(rss: list[int]) -> float:
    """Median growth between consecutive samples of ``rss``, in bytes.

    A leak adds about the same amount in every round of a test, while the allocator
    keeps freed memory in jumps (an arena, a buffer it holds on to: several MiB once,
    at an unforeseeable round). The median of the steps sees the first and ignores the
    second, as long as fewer than half the steps jump.
    """
    if len(rss) < 2:
        raise ValueError(f"steady_growth needs two samples or more, got {len(rss)}")
    return statistics.median(b - a for a, b in itertools.pairwise(rss))


def shm_mappings(pid: int) -> set[str]:
    """Names of the /dev/shm files that ``pid`` has mapped right now."""
    names = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith("/dev/shm/"):
                names.add(path.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return names
