"""What verify reports: each check's statistics over real numbers from both sides (CheckStats -> CheckResult), the
K/V divergence per (layer, head), the report written to an artifact as parity.json, what makes it fail, and its text
for a terminal (format_report). No session, no model here: parity.py runs the checks and fills these in."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from kvserve.contract.tolerances import Tolerance, kl_divergence, logits_bound


@dataclass(frozen=True)
class CheckResult:
    """One logits (and K/V) comparison over real numbers from both sides."""

    name: str
    max_abs_logits: float
    max_abs_eager_logit: float  # the scale of a relative logits bound
    mean_abs_logits: float
    top1_agreement: float
    kl_mean: float  # mean KL(eager || onnx) per compared position
    kv_max_abs: float | None  # worst (layer, head) K/V difference (relative where the tolerance is); None: no K/V compared
    passed: bool


@dataclass(frozen=True)
class GreedyResult:
    steps: int
    identical: bool
    onnx: list[list[int]]  # (B, steps)
    eager: list[list[int]]


@dataclass(frozen=True)
class ArgmaxResult:
    """A slots graph's greedy_tokens output against its own logits' argmax, every row of every step."""

    rows: int
    mismatches: int


@dataclass(frozen=True)
class LayerHead:
    layer: int
    head: int  # a K/V head (fewer than the query heads in a grouped-query model)
    max_abs: float


@dataclass
class ParityReport:
    """What verify found; written to the artifact as parity.json (to_json)."""

    artifact: str
    dtype: str
    quantization: str | None
    kv_cache: str
    attention: str
    provider: str
    provider_note: str | None
    tolerance: Tolerance
    checks: list[CheckResult]
    greedy: GreedyResult
    text: dict | None  # quantized artifacts: held-out text (quality.text_quality) and whether it passed
    greedy_tokens_argmax: ArgmaxResult | None  # None: a concat graph (no greedy_tokens)
    kv_max_abs_per_layer_head: list[list[float]]  # (L, H_kv)
    first_failing_layer_head: LayerHead | None
    failures: list[str] = field(default_factory=list)
    kv_dtype: str | None = None  # what the K/V pool holds where it differs from dtype; None: dtype
    # the eager model's own error in the artifact's dtype ({"logits", "kv"}, export/own_rounding.py), measured where a
    # check fell outside the fixed bounds and the tolerance holds it to a multiple of that; None: not needed
    own_rounding: dict | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


class CheckStats:
    """Running logits statistics for one named check."""

    def __init__(self, name: str):
        self.name, self.max_abs, self.sum_abs, self.count, self.agree, self.positions = name, 0.0, 0.0, 0, 0, 0
        self.kl_sum = 0.0
        self.eager_max_abs = 0.0  # the largest |eager logit| seen: the scale of a relative logits tolerance
        self.kv_max_abs: float | None = None  # None: this check compares no K/V

    def add_logits(self, onnx_logits: np.ndarray, eager_logits: np.ndarray) -> None:
        """Both (N, V): one row per compared position."""
        diff = np.abs(onnx_logits.astype(np.float64) - eager_logits.astype(np.float64))
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.count += diff.size
        self.agree += int((onnx_logits.argmax(-1) == eager_logits.argmax(-1)).sum())
        self.positions += onnx_logits.shape[0]
        self.kl_sum += float(kl_divergence(eager_logits, onnx_logits).sum())  # KL(eager || onnx)
        self.eager_max_abs = max(self.eager_max_abs, float(np.abs(eager_logits).max()))

    def result(self, tolerance: Tolerance) -> CheckResult:
        top1 = self.agree / self.positions
        check = CheckResult(self.name, self.max_abs, self.eager_max_abs, self.sum_abs / self.count, top1, self.kl_sum / self.positions,
                            self.kv_max_abs, passed=False)
        return judged(check, tolerance)


def judged(check: CheckResult, tolerance: Tolerance) -> CheckResult:
    """check with passed set by tolerance."""
    passed = check.max_abs_logits <= logits_bound(tolerance, np.array(check.max_abs_eager_logit)) and check.top1_agreement >= tolerance.top1_min
    passed = passed and (check.kv_max_abs is None or check.kv_max_abs <= tolerance.kv_max_abs)
    passed = passed and (tolerance.kl_mean_max is None or check.kl_mean <= tolerance.kl_mean_max)
    return replace(check, passed=passed)


def kv_divergence(onnx_rows: list[list[np.ndarray]], eager_present: list, real: np.ndarray, relative: bool = False,
                  rms: bool = False) -> np.ndarray:
    """Max |Δ| per (layer, head) over the real (unpadded) positions. onnx_rows: per batch row, per layer K then
    V, each (H, L_r, d_k) holding that row's real positions in order (a ring layer's last ones); eager_present: per layer (K, V), each
    (B, H, S, d_k), with real (B, S) bool marking the positions that hold tokens. relative: divided by the
    eager K/V's largest |value| in that (layer, head). rms: each batch row's root-mean-square |Δ| over its eager K/V's
    root mean square instead (the worst row, K or V). Returns (L, H)."""
    per_layer = []
    for layer, (eager_k, eager_v) in enumerate(eager_present):
        worst = None
        for offset, eager_kv in ((0, eager_k), (1, eager_v)):
            eager_kv = eager_kv.double().numpy()
            for row, onnx_row in enumerate(onnx_rows):
                eager_row = eager_kv[row][:, real[row]]  # (H, L_r, d_k)
                eager_row = eager_row[:, eager_row.shape[1] - onnx_row[2 * layer + offset].shape[1]:]  # a ring row holds its last positions
                difference = onnx_row[2 * layer + offset].astype(np.float64) - eager_row  # (H, L_r, d_k)
                if rms:
                    head_max = np.sqrt((difference**2).mean(axis=(1, 2)) / np.maximum((eager_row**2).mean(axis=(1, 2)), 1e-24))  # (H,)
                else:
                    head_max = np.abs(difference).max(axis=(1, 2))  # (H,)
                    if relative:
                        head_max = head_max / np.maximum(np.abs(eager_row).max(axis=(1, 2)), 1e-12)
                worst = head_max if worst is None else np.maximum(worst, head_max)
        per_layer.append(worst)
    return np.stack(per_layer)  # (L, H)


def failures_of(report: ParityReport, precision: str) -> list[str]:
    failures = [f"{c.name}: outside {precision} tolerance" for c in report.checks if not c.passed]
    if report.text is not None and not report.text["passed"]:
        failures.append(f"held-out text: outside {precision} tolerance")
    if report.tolerance.greedy_identical and not report.greedy.identical:
        failures.append("greedy tokens differ from the eager reference")
    argmax = report.greedy_tokens_argmax
    if argmax is not None and argmax.mismatches:
        failures.append(f"the graph's greedy_tokens differ from its logits' argmax at {argmax.mismatches} of {argmax.rows} rows")
    bad = report.first_failing_layer_head
    if bad is not None:
        failures.append(f"present K/V first breaks tolerance at layer {bad.layer}, head {bad.head}")
    return failures


def format_report(report: ParityReport) -> str:
    """A markdown table of the checks, then the greedy, K/V and provider lines."""
    tol = report.tolerance
    relative = tol.logits_relative
    weights = f", {report.quantization} weights" if report.quantization else ""
    weights += f", {report.kv_dtype} K/V" if report.kv_dtype else ""
    lines = [
        f"parity: {report.artifact} ({report.dtype}{weights}, {report.kv_cache} KV cache"
        f"{', fused attention' if report.attention == 'fused' else ''}) on {report.provider}",
        "",
        f"| check | max abs Δ logits{' (of max abs logit)' if relative else ''} | mean abs Δ logits | top-1 agree | mean KL | "
        f"{'rel. RMS' if tol.kv_rms else 'rel. max abs' if tol.kv_relative else 'max abs'} Δ K/V | ok |",
        "|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for c in report.checks:
        kv = "n/a" if c.kv_max_abs is None else f"{c.kv_max_abs:.2e}"
        scale = f" (of {c.max_abs_eager_logit:.3g})" if relative else ""
        lines.append(f"| {c.name} | {c.max_abs_logits:.2e}{scale} | {c.mean_abs_logits:.2e} | {c.top1_agreement:.3f} | "
                     f"{c.kl_mean:.1e} | {kv} | {'yes' if c.passed else 'NO'} |")
    lines += ["", f"greedy {report.greedy.steps} steps: tokens {'identical' if report.greedy.identical else 'DIFFER'}"]
    argmax = report.greedy_tokens_argmax
    if argmax is not None:
        lines.append(f"greedy_tokens output vs its logits' argmax: {argmax.rows - argmax.mismatches} of {argmax.rows} rows equal")
    kv = np.array(report.kv_max_abs_per_layer_head)  # (L, H_kv)
    measure = "relative RMS" if tol.kv_rms else "max abs"  # what kv_divergence measured under this tolerance
    lines.append(f"present K/V {measure} Δ per layer (worst head): "
                 + ", ".join(f"L{i}={row.max():.1e} (h{int(row.argmax())})" for i, row in enumerate(kv)))
    text = report.text
    if text is not None:
        lines.append(
            f"held-out text, teacher-forced ({text['positions']} positions): top-1 agree {text['top1_agreement']:.3f}, "
            f"mean KL {text['kl_mean']:.2e}, perplexity {text['perplexity_onnx']:.3f} vs eager {text['perplexity_eager']:.3f} "
            f"(x{text['perplexity_ratio']:.4f}); greedy prefix matching eager: {text['greedy_prefix']} of {text['greedy_steps']}"
        )
        if not text["learned"]:
            lines.append("held-out text: the eager model has not learned it (perplexity near its vocabulary's size): mean KL "
                         "held, top-1, perplexity and greedy prefix reported")
    bad = report.first_failing_layer_head
    lines.append("first (layer, head) over tolerance: "
                 + (f"layer {bad.layer}, head {bad.head} ({measure} Δ {bad.max_abs:.2e})" if bad else "none"))
    lines.append(
        f"tolerance ({report.quantization or report.dtype}{f', {report.kv_dtype} K/V' if report.kv_dtype else ''}): logits {tol.logits_max_abs:g}{' (relative)' if relative else ''}, "
        f"K/V {tol.kv_max_abs:g}{' (relative RMS)' if tol.kv_rms else ' (relative)' if tol.kv_relative else ''}, top-1 >= {tol.top1_min:g}"
        + (f", mean KL <= {tol.kl_mean_max:g}" if tol.kl_mean_max is not None else "")
        + f", greedy identical {'required' if tol.greedy_identical else 'reported'}"
    )
    if report.own_rounding is not None:
        own = report.own_rounding
        lines.append(f"the eager model itself in {report.dtype}: logits {own['logits']:.2e} of the largest, K/V {own['kv']:.2e} relative "
                     f"off its float32 self; the bounds above are {tol.own_rounding_multiple:g}x that where it exceeds the fixed ones")
    if tol.text is not None:
        t = tol.text
        lines.append(f"held-out text tolerance: top-1 >= {t.top1_min:g}, mean KL <= {t.kl_mean_max:g}, "
                     f"perplexity ratio <= {t.perplexity_ratio_max:g}, mean greedy prefix >= {t.greedy_prefix_min}")
    if report.provider_note:  # CUDA is here but did not start
        lines.append(f"note: ran on the CPU provider, not CUDA ({report.provider_note})")
    lines.append(f"result: {'PASS' if report.passed else 'FAIL: ' + '; '.join(report.failures)}")
    return "\n".join(lines)


def write_report(report: ParityReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
