"""bench/gpu_check.sh, what a lent GPU machine runs, held without a GPU: every part runs to its end here with the Python
it calls replaced by a recorder, and every call it would make is checked as its callee would check it (the CLI's and each
bench script's own argument parser, pytest's collection of the tests it names under each -k), and each artifact a call
reads comes from an earlier call of the same run. A flag renamed in a script, a test renamed, or a part that reads what
only another part writes would otherwise cost minutes of a 15-minute loan to find."""

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import build_parser

from .conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"
FIELD = "\x1f"
# What a call writes, by flag: an export's artifact, a script's working folder (everything under it is its own).
WRITES = ("--out", "--work")


def parts() -> list[str]:
    return re.findall(r"^    (\w+)\)$", SCRIPT.read_text(), re.M)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-check")


@pytest.fixture(scope="module")
def recorded(work) -> dict[str, list[tuple[str, list[str]]]]:
    """{PARTS value: [(KVSERVE_TEST_PROVIDER, argv after the interpreter), ...]} for the default run and each part alone
    (bench reads what parity writes: the default runs them in order), its artifacts under work/art."""
    bin_dir = work / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "python-recorder"
    recorder.write_text('#!/usr/bin/env bash\n{ printf "%s\\x1f" "${KVSERVE_TEST_PROVIDER:-}" "$@"; printf "\\n"; } >>"$CALLS"\n')
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 81559 MiB, 580.00'\n")
    for tool in (recorder, smi):
        tool.chmod(0o755)
    runs = {}
    for parts_value in ["", *[part for part in parts() if part != "bench"]]:
        calls = work / f"calls-{parts_value or 'default'}"
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(recorder), "CALLS": str(calls),
               "RESULTS": str(work / "results"), "ART": str(work / "art"), "PARTS": parts_value}
        if not parts_value:
            del env["PARTS"]
        env.pop("LOG", None)
        done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "!! failed" not in done.stdout, (parts_value, done.stdout[-2000:], done.stderr[-2000:])
        lines = calls.read_text().splitlines()
        runs[parts_value or "default"] = [(fields[0], fields[1:-1]) for fields in (line.split(FIELD) for line in lines)]
    return runs


def calls_of(recorded, kind: str) -> list[list[str]]:
    seen, unique = set(), []
    for calls in recorded.values():
        for provider, argv in calls:
            if call_kind(argv) == kind and tuple(argv) not in seen:
                seen.add(tuple(argv))
                unique.append(argv)
    return unique


def call_kind(argv: list[str]) -> str:
    if argv[:1] == ["-c"]:
        return "check"
    if argv[:2] == ["-m", "kvserve.cli"]:
        return "cli"
    if argv[:2] == ["-m", "pytest"]:
        return "pytest"
    if argv and re.fullmatch(r"bench/\w+\.py", argv[0]):
        return "bench"
    return "other"


def test_every_part_runs_and_every_call_is_one_the_checks_know(recorded):
    assert set(recorded) == {"default", *parts()} - {"bench"}
    assert len(parts()) >= 9, parts()
    for name, calls in recorded.items():
        kinds = [call_kind(argv) for _, argv in calls]
        assert kinds[0] == "check" and "other" not in kinds, (name, calls)
        assert len(kinds) >= 2, name  # the check, then at least one step


def test_every_export_it_runs_parses_and_names_what_exists(recorded):
    exports = calls_of(recorded, "cli")
    assert len(exports) >= 10
    for argv in exports:
        args = build_parser().parse_args(argv[2:])  # the CLI's one-line refusal is a SystemExit: a failure here
        assert args.command == "export" and args.provider == "cuda", argv
        if args.checkpoint:
            assert (REPO / args.checkpoint / "config.json").is_file(), argv


class _Parsed(Exception):
    pass


def test_every_bench_script_it_runs_takes_its_arguments(recorded, monkeypatch, capsys):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "path", list(sys.path))
    scripts = calls_of(recorded, "bench")
    assert len({argv[0] for argv in scripts}) >= 10
    for argv in scripts:
        monkeypatch.setattr(sys, "argv", argv)
        try:
            runpy.run_path(str(REPO / argv[0]), run_name="__main__")
        except _Parsed:
            continue
        except SystemExit:
            pytest.fail(f"{' '.join(argv)}: {capsys.readouterr().err.strip()}")
        pytest.fail(f"{argv[0]} ended without parsing its arguments")


def test_every_test_run_is_on_cuda_and_selects_tests(recorded):
    runs = [(provider, argv) for calls in recorded.values() for provider, argv in calls if call_kind(argv) == "pytest"]
    assert {provider for provider, _ in runs} == {"cuda"}
    for argv in calls_of(recorded, "pytest"):
        collected = subprocess.run([sys.executable, *argv, "--collect-only", "-q"], cwd=REPO, capture_output=True, text=True,
                                   timeout=120)
        # pytest exits 5 where nothing is selected and 4 on a path that is not there
        assert collected.returncode == 0, (argv, collected.stdout[-1500:], collected.stderr[-1500:])


def test_every_artifact_a_call_reads_an_earlier_call_wrote(recorded, work):
    art = str(work / "art")
    read = 0
    for name, calls in recorded.items():
        written: list[str] = []
        for _, argv in calls:
            outputs = {argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag in WRITES}
            for token in argv:
                if token.startswith(art + "/") and token not in outputs:
                    assert any(token == path or token.startswith(path + "/") for path in written), (name, token, argv)
                    read += 1
            written.extend(outputs)
    assert read >= 20
