"""proto/ passes `buf lint` with buf's default rules, and the committed stubs are not hand-edited."""

import subprocess

from .conftest import REPO


def test_buf_lint_passes_with_the_default_rules():
    buf = REPO / "node_modules" / ".bin" / "buf"
    assert buf.exists(), "buf is missing: `make tools` installs it (pinned in package.json)"
    result = subprocess.run([str(buf), "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_stubs_are_not_tracked_by_git():
    tracked = subprocess.run(["git", "ls-files", "kvserve/v1"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert tracked == ["kvserve/v1/__init__.py"]
