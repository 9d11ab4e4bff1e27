"""runtime/machine_memory.py: the memory limit is the process's own cgroup's (v1 or v2) where it is below the machine's,
read from /proc/self/cgroup's path, and the machine's where no group limits it."""

from __future__ import annotations

import subprocess
import sys
import uuid

from kvserve.runtime import machine_memory
from kvserve.runtime.machine_memory import CGROUP_ROOT, _own_groups, memory_limit


def test_own_groups_are_read_from_each_hierarchy_line():
    text = "12:memory:/kvserve-test\n8:pids:/\n0::/system.slice/x.scope\n3:cpu,memory:/nested/group\n"
    assert _own_groups(text) == [CGROUP_ROOT / "memory" / "kvserve-test" / "memory.limit_in_bytes",
                                 CGROUP_ROOT / "system.slice/x.scope" / "memory.max",
                                 CGROUP_ROOT / "memory" / "nested/group" / "memory.limit_in_bytes"]


def test_a_lower_group_limit_wins_and_no_limit_keeps_the_machines(tmp_path, monkeypatch):
    limited, unlimited = tmp_path / "limited", tmp_path / "unlimited"
    for group, text in ((limited, "1073741824\n"), (unlimited, "max\n")):
        group.mkdir()
        (group / "memory.max").write_text(text)
    machine = memory_limit()
    monkeypatch.setattr(machine_memory, "_own_groups", lambda _: [limited / "memory.max"])
    assert memory_limit() == min(machine, 1073741824)
    monkeypatch.setattr(machine_memory, "_own_groups", lambda _: [unlimited / "memory.max"])
    assert memory_limit() == machine
    (tmp_path / "memory.max").write_text("2147483648\n")  # a container whose own path is not mounted: its root is its group
    monkeypatch.setattr(machine_memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(machine_memory, "_own_groups", lambda _: [tmp_path / "docker" / "abc" / "memory.max"])
    assert memory_limit() == min(machine, 2147483648)


def test_a_process_in_a_v1_group_reads_that_groups_limit():
    group = CGROUP_ROOT / "memory" / f"kvserve-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    except OSError:  # no writable cgroup v1 here: the unit tests above hold the reading
        if group.exists():
            group.rmdir()
        return
    try:
        code = "from kvserve.runtime.machine_memory import memory_limit; print(memory_limit())"
        run = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert int(run.stdout) == min(memory_limit(), 3 * 2**30)
    finally:
        group.rmdir()
