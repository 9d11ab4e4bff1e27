"""bench/gpu_check.sh, what a lent GPU machine runs, held without a GPU: every part runs to its end here with the Python
it calls replaced by a recorder, and every call it would make is checked as its callee would check it (the CLI's and each
bench script's own argument parser, pytest's collection of the tests it names under each -k), and each artifact a call
reads comes from an earlier call of the same run; a run resumed after a cut (RESUME=1) makes only the calls its earlier
run did not finish. A flag renamed in a script, a test renamed, or a part that reads what only another part writes
would otherwise cost minutes of a 15-minute loan to find."""

import argparse
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.cli import build_parser

from .conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"
FIELD = "\x1f"
# The variables the script reads from its caller: none leaks in from the environment the tests run in.
SCRIPT_VARIABLES = ("LOG", "RESUME", "PARTS", "PYTEST_ARGS", "TESTS_TIMEOUT", "RESULTS", "ART", "PYTHON")
# What a call writes, by flag: an export's artifact, a script's working folder (everything under it is its own).
WRITES = ("--out", "--work")


def parts() -> list[str]:
    return re.findall(r"^    (\w+)\)$", SCRIPT.read_text(), re.M)


@dataclass
class GpuCheckRun:
    returncode: int
    output: str  # its stdout, then its stderr
    calls: list[tuple[str, list[str]]]  # (KVSERVE_TEST_PROVIDER, argv after the interpreter) of each call


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A scratch folder with a recorder for Python and a stand-in nvidia-smi under bin/; artifacts go under art/."""
    work = tmp_path_factory.mktemp("gpu-check")
    (work / "bin").mkdir()
    recorder = work / "bin" / "python-recorder"
    recorder.write_text('#!/usr/bin/env bash\n{ printf "%s\\x1f" "${KVSERVE_TEST_PROVIDER:-}" "$@"; printf "\\n"; } >>"$CALLS"\n')
    smi = work / "bin" / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 81559 MiB, 580.00'\n")
    for tool in (recorder, smi):
        tool.chmod(0o755)
    return work


def run_gpu_check(work: Path, parts_value: str | None, results: str = "results", **env_vars: str) -> GpuCheckRun:
    """bench/gpu_check.sh with PARTS=parts_value (None: its default), its Python the recorder, its results under
    work/results (a folder of that name), its artifacts under work/art."""
    calls = work / f"calls-{len(list(work.glob('calls-*')))}"
    env = {name: value for name, value in os.environ.items() if name not in SCRIPT_VARIABLES}
    env.update(PATH=f"{work / 'bin'}:{os.environ['PATH']}", PYTHON=str(work / "bin" / "python-recorder"), CALLS=str(calls),
               RESULTS=str(work / results), ART=str(work / "art"), **env_vars)
    if parts_value is not None:
        env["PARTS"] = parts_value
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return GpuCheckRun(done.returncode, done.stdout + done.stderr,
                       [(fields[0], fields[1:-1]) for fields in (line.split(FIELD) for line in lines)])


@pytest.fixture(scope="module")
def recorded(work) -> dict[str, list[tuple[str, list[str]]]]:
    """{PARTS value: its calls} for the default run and each part alone (bench reads what parity writes: the default
    runs them in order)."""
    runs = {}
    for parts_value in [None, *[part for part in parts() if part != "bench"]]:
        run = run_gpu_check(work, parts_value)
        assert run.returncode == 0 and "!! failed" not in run.output, (parts_value, run.output[-2000:])
        runs[parts_value or "default"] = run.calls
    return runs


def calls_of(recorded, kind: str) -> list[list[str]]:
    seen, unique = set(), []
    for calls in recorded.values():
        for _, argv in calls:
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


def test_a_resumed_run_goes_on_from_the_first_step_an_earlier_run_did_not_finish(work):
    whole = run_gpu_check(work, "next", results="resumed")
    steps = (work / "resumed" / "finished").read_text().splitlines()
    assert whole.returncode == 0 and len(steps) == len(whole.calls) - 1 >= 10  # the check, then a call a step
    kept = steps[:3]
    kept[1] = kept[1].replace(" ok", " failed")
    (work / "resumed" / "finished").write_text("".join(f"{line}\n" for line in kept))  # as if cut in its 4th step
    resumed = run_gpu_check(work, "next", results="resumed", RESUME="1")
    assert resumed.calls == whole.calls[:1] + whole.calls[4:]
    assert resumed.returncode == 1 and f"failed in an earlier run: {kept[1].split()[0]}" in resumed.output
    assert (work / "resumed" / "finished").read_text().splitlines() == kept + steps[3:]
    again = run_gpu_check(work, "next", results="resumed")  # without RESUME a run starts over
    assert again.calls == whole.calls and again.returncode == 0


def test_the_wheels_carried_to_a_gpu_host_are_the_versions_kvserve_pins():
    """bench/gpu_wheels.sh carries what the GPU image lacks; a pin moved in constraints.txt and not there would put
    another version beside the generated protobuf code or the server on the loan."""
    script = (REPO / "bench" / "gpu_wheels.sh").read_text()
    carried = re.search(r"^WHEELS=\((.*?)\)$", script, re.M | re.S).group(1).split()
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line and not line.startswith("#"))
    pins = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins.items()}
    assert len(carried) >= 20
    for wheel in carried:
        name, version = wheel.split("==")
        assert pins.get(re.sub(r"[-_.]+", "-", name).lower()) == version, wheel
