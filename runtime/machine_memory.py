"""The memory this process may use: the machine's, or the limit of the cgroup the process runs in where that is lower.

The process's own group is read from /proc/self/cgroup (a container sees its own as "/", a process put in a nested
group, as tests/export/test_bounded_export.py does, that group's path), on cgroup v2 (memory.max) or v1
(memory.limit_in_bytes under the memory controller), beside the mount's root group: a container without a cgroup
namespace names a path it cannot see, and its root there is its own group. The lowest limit read wins (a group's limit
holds its children); the groups between are not climbed.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_groups(proc_cgroup: str) -> list[Path]:
    """The limit files of this process's groups, from /proc/self/cgroup's lines (id:controllers:path)."""
    files = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        relative = path.strip().lstrip("/")
        if controllers == "":  # v2's unified hierarchy
            files.append(CGROUP_ROOT / relative / "memory.max")
        elif "memory" in controllers.split(","):
            files.append(CGROUP_ROOT / "memory" / relative / "memory.limit_in_bytes")
    return files


def memory_limit() -> int:
    """Bytes this process may use: MemTotal, or its cgroup's memory limit where that is lower."""
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    try:
        own = _own_groups(Path("/proc/self/cgroup").read_text())
    except OSError:
        own = []
    for path in [*own, CGROUP_ROOT / "memory.max", CGROUP_ROOT / "memory" / "memory.limit_in_bytes"]:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))  # "max" (v2) or v1's huge number for "no limit": the machine's stays
    return total
