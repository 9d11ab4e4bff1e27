"""The Makefile, every entry point a newcomer uses: `make help` lists each target, and what `make bench` runs exists."""

import re
import subprocess

from .conftest import REPO


def test_make_help_lists_every_target():
    makefile = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY: (.+)$", makefile, re.M).group(1).split()
    listed = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    shown = {line.split()[1] for line in listed.splitlines() if line.startswith("make ")}
    assert set(phony) == shown, set(phony) ^ shown


def test_every_script_make_bench_runs_is_there():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\nbench:"):]
    recipe = recipe[: recipe.index("\n\n")]
    scripts = re.findall(r"(bench/\w+\.py)", recipe)
    assert len(scripts) >= 8 and all((REPO / script).is_file() for script in scripts), scripts
