"""What /proc says about a process: resident memory and mapped shared memory."""

from __future__ import annotations


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def shm_mappings(pid: int) -> set[str]:
    """Names of the /dev/shm files that ``pid`` has mapped right now."""
    names = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith("/dev/shm/"):
                names.add(path.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return names
