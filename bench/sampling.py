"""One sampled token's draw (service/core/sampling.py `choose`) over a vocabulary's logits, by vocabulary size and
sampling options, on the step thread's path: each sampled row draws once a step, and once more at every draft it checks.

Logits are made-up but shaped like a model's: normal, spread 3 (peaked: a nucleus of tens to hundreds of tokens) or 1
(flat: a top_p nucleus of tens of thousands). With --baseline-python the same draws run in turn under another
environment's interpreter, one where another checkout of kvserve is installed (bench/serving_latency.py says how to make
one), old and new alternating round by round; the table gives each one's best round.

    python bench/sampling.py [--rounds 5] [--draws 200] [--baseline-python /tmp/old/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

VOCABULARIES = {"kjv-gpt2 (4,096)": 4096, "gpt2 (50,257)": 50257, "Qwen (151,936)": 151936}
OPTIONS = {"temperature 0.8": {"temperature": 0.8}, "top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
           "top_k 40": {"temperature": 0.7, "top_k": 40}, "min_p 0.05": {"temperature": 1.0, "min_p": 0.05}}
SPREADS = {"peaked": 3.0, "flat": 1.0}


def cases() -> list[tuple[str, str, str]]:
    return [(vocabulary, option, spread) for vocabulary in VOCABULARIES for option in OPTIONS for spread in SPREADS
            if spread == "peaked" or option == "top_p 0.9"]  # a flat spread changes only top_p's work


def time_draws(draws: int) -> dict[str, float]:
    """{case: ms a draw} with the kvserve this interpreter imports."""
    from kvserve.service.core.sampling import SamplingParams, choose

    times = {}
    for vocabulary, option, spread in cases():
        logits = (np.random.default_rng(0).standard_normal(VOCABULARIES[vocabulary]) * SPREADS[spread]).astype(np.float32)
        params, rng = SamplingParams(**OPTIONS[option]), np.random.default_rng(1)
        choose(logits, params, rng, None)
        start = time.perf_counter()
        for _ in range(draws):
            choose(logits, params, rng, None)
        times["|".join((vocabulary, option, spread))] = (time.perf_counter() - start) / draws * 1e3
    return times


def run_in(python: str, draws: int) -> dict[str, float]:
    # not from a checkout: the interpreter's own installed kvserve is the one timed
    out = subprocess.run([python, str(Path(__file__).resolve()), "--worker", "--draws", str(draws)], capture_output=True, text=True,
                         check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=200, help="draws a case, a round")
    parser.add_argument("--baseline-python", help="another environment's interpreter, timed in turn with this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.draws < 1:
        parser.error("--rounds and --draws must be >= 1")
    if args.worker:
        print(json.dumps(time_draws(args.draws)))
        return
    pythons = {"new": sys.executable} | ({"baseline": args.baseline_python} if args.baseline_python else {})
    best: dict[str, dict[str, float]] = {name: {} for name in pythons}
    for round_ in range(args.rounds):
        for name in (list(pythons) if round_ % 2 == 0 else list(pythons)[::-1]):
            try:
                timed = run_in(pythons[name], args.draws)
            except (OSError, subprocess.CalledProcessError) as exc:
                last = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()[-1:]
                parser.error(f"{pythons[name]}: cannot time kvserve's sampling there ({last[0] if last else exc})")
            for case, ms in timed.items():
                best[name][case] = min(ms, best[name].get(case, ms))
    print(f"# One sampled draw (sampling.choose), ms, best of {args.rounds} rounds of {args.draws} draws\n")
    columns = list(pythons)
    header = "| vocabulary | options | logits | " + " | ".join(columns) + (" | baseline / new |" if len(columns) > 1 else " |")
    print(header + "\n|---|---|---|" + "---:|" * (len(columns) + (len(columns) > 1)))
    for vocabulary, option, spread in cases():
        case = "|".join((vocabulary, option, spread))
        cells = [f"{best[name][case]:.3f}" for name in columns]
        if len(columns) > 1:
            cells.append(f"{best['baseline'][case] / best['new'][case]:.1f}x")
        print(f"| {vocabulary} | {option} | {spread} | " + " | ".join(cells) + " |")
    print(f"\nmachine: {describe()}")


if __name__ == "__main__":
    main()
