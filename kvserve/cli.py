"""`kvserve`: the command line. Each subcommand imports only what it needs, so `serve` and `generate`
never load torch (the serving image does not have it)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.errors import JobFailed, UserError


def _export(args) -> int:
    from kvserve.export.pipeline import export_artifact, load_source
    from kvserve.export.parity import format_report

    model, source = load_source(args.preset, args.checkpoint, args.seed)
    report = export_artifact(
        model, source, args.out, dtype=args.dtype, overwrite=args.overwrite, provider=args.provider,
        tokenizer_dir=args.checkpoint,
    )
    print(format_report(report))
    print(f"artifact written to {args.out}")
    return 0


def _verify(args) -> int:
    from pathlib import Path

    from kvserve.export.artifact import PARITY_FILE
    from kvserve.export.parity import format_report, verify, write_report
    from kvserve.export.pipeline import reference_for

    report = verify(args.artifact, reference_for(args.artifact, args.checkpoint), provider=args.provider, steps=args.steps)
    print(format_report(report))
    report_path = Path(args.report) if args.report else Path(args.artifact) / PARITY_FILE
    write_report(report, report_path)
    print(f"report written to {report_path}")
    return 0 if report["passed"] else JobFailed.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export a checkpoint or preset to a verified ONNX artifact")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a built-in config with seeded random weights (tiny, gpt2)")
    source.add_argument("--checkpoint", help="a GPT-2-format checkpoint directory (config.json + weights)")
    export.add_argument("--out", required=True, help="the artifact directory to write")
    export.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    export.add_argument("--seed", type=int, default=0, help="weight seed for --preset (default 0)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing artifact directory")
    export.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto", help="for the parity check")
    export.set_defaults(run=_export)

    verify = commands.add_parser("verify", help="check an artifact against the eager reference; non-zero on failure")
    verify.add_argument("artifact", help="the artifact directory")
    verify.add_argument("--checkpoint", help="the reference weights (default: the artifact's recorded source)")
    verify.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto")
    verify.add_argument("--steps", type=int, default=8, help="decode and greedy steps (default 8)")
    verify.add_argument("--report", help="where to write the JSON report (default: ARTIFACT/parity.json)")
    verify.set_defaults(run=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Our own loggers speak at INFO; libraries (the exporter's passes, grpc) only when something is wrong.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # unreadable or unwritable paths: the OS message names the file
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return UserError.exit_code


if __name__ == "__main__":
    sys.exit(main())
