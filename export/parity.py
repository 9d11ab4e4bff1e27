"""Parity: the exported graph on ONNX Runtime against the eager reference, on the same weights.

Checks, each over real numbers from both sides:
  prefill    several batch sizes and prompt lengths (left-padded, or for the slots layout a row each, in
             chunks); logits and present K/V at every real position
  decode     cached single-token steps after a prefill, both sides fed the same tokens
  recompute  the cached decode's last logits against a full recompute of the whole sequence (past = 0)
  greedy     ONNX Runtime's own greedy loop against the eager reference's tokens
  text       quantized artifacts only: teacher-forced held-out text (export/quality.py)
  argmax     slots graphs with greedy_tokens: that output equals its own logits' argmax at every row of every step
The present K/V divergence is kept per (layer, head), so a broken tolerance names where it starts (the K/V
heads: a grouped-query model's cache holds fewer heads than it has query heads).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import ArtifactError, contract_problems, open_artifact
from kvserve.contract.tokenizer import load_tokenizer
from kvserve.contract.tolerances import TOLERANCES, Tolerance, kl_divergence, logits_bound
from kvserve.errors import UserError
from kvserve.model.decoders import Decoder
from kvserve.model.generate import generate, left_pad, position_ids_from_mask
from kvserve.progress import stage
from kvserve.runtime.pool import pool_capacity
from kvserve.runtime.step import DecoderRuntime

from .quality import eval_windows, greedy_tokens, text_quality


class VerifyRefused(UserError):
    """verify was asked for something this artifact cannot be checked with; nothing ran."""


PREFILL_CASES = ((1,), (17,), (5, 12), (1, 8, 16, 33))  # prompt lengths, one per batch row
DECODE_PROMPTS = (7, 13)
GREEDY_PROMPTS = (5, 9)
# A model whose held-out perplexity is above this share of its vocabulary has not learned the text (the trained
# default model: 22 of 4,096; the random gpt2 preset: 57,000 of 50,257).
LEARNED_PERPLEXITY_SHARE = 0.1


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

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


class _Check:
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

    def result(self, tolerance: Tolerance) -> "CheckResult":
        top1 = self.agree / self.positions
        kl_mean = self.kl_sum / self.positions
        passed = self.max_abs <= logits_bound(tolerance, np.array(self.eager_max_abs)) and top1 >= tolerance.top1_min
        passed = passed and (self.kv_max_abs is None or self.kv_max_abs <= tolerance.kv_max_abs)
        passed = passed and (tolerance.kl_mean_max is None or kl_mean <= tolerance.kl_mean_max)
        return CheckResult(self.name, self.max_abs, self.eager_max_abs, self.sum_abs / self.count, top1, kl_mean, self.kv_max_abs, passed)


def _kv_divergence(onnx_rows: list[list[np.ndarray]], eager_present: list, real: np.ndarray, relative: bool = False) -> np.ndarray:
    """Max |Δ| per (layer, head) over the real (unpadded) positions. onnx_rows: per batch row, per layer K then
    V, each (H, L_r, d_k) holding that row's real positions in order; eager_present: per layer (K, V), each
    (B, H, S, d_k), with real (B, S) bool marking the positions that hold tokens. relative: divided by the
    eager K/V's largest |value| in that (layer, head). Returns (L, H)."""
    per_layer = []
    for layer, (eager_k, eager_v) in enumerate(eager_present):
        worst = None
        for offset, eager_kv in ((0, eager_k), (1, eager_v)):
            eager_kv = eager_kv.double().numpy()
            for row, onnx_row in enumerate(onnx_rows):
                eager_row = eager_kv[row][:, real[row]]  # (H, L_r, d_k)
                head_max = np.abs(onnx_row[2 * layer + offset].astype(np.float64) - eager_row).max(axis=(1, 2))  # (H,)
                if relative:
                    head_max = head_max / np.maximum(np.abs(eager_row).max(axis=(1, 2)), 1e-12)
                worst = head_max if worst is None else np.maximum(worst, head_max)
        per_layer.append(worst)
    return np.stack(per_layer)  # (L, H)


class _ConcatDriver:
    """Drives a concat graph the way Optimum-style tools do: a left-padded batch, each step's present fed back as past."""

    argmax_rows = argmax_mismatches = 0  # a concat graph has no greedy_tokens output to check

    def __init__(self, runtime: DecoderRuntime, config):
        self.runtime, self.config = runtime, config
        self.past_names = [name for layer in range(config.n_layer) for name in io.past_names(layer)]

    def _run(self, ids, past) -> np.ndarray:
        feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: self.mask.numpy(), io.POSITION_IDS: self.pos.numpy(), **dict(zip(self.past_names, past))}
        logits, *self.past = self.runtime.run_feeds(feeds)
        return logits  # (B, T, V)

    def prefill(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Prompts from an empty cache; returns each row's logits at every prompt position, (L_r, V)."""
        ids, self.mask = left_pad(prompts)  # (B, T)
        self.pos = position_ids_from_mask(self.mask)
        empty = np.zeros((len(prompts), self.config.n_kv_head, 0, self.config.d_head), self.runtime.kv_dtype)  # (B, H_kv, 0, d_k)
        logits = self._run(ids.numpy(), [empty] * len(self.past_names))
        real = self.mask.numpy().astype(bool)
        return [logits[row][real[row]] for row in range(len(prompts))]

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """One token per row (B,); returns the next-token logits (B, V)."""
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
        self.pos = self.pos[:, -1:] + 1  # (B, 1)
        return self._run(np.asarray(tokens, np.int64)[:, None], self.past)[:, -1]

    def kv(self) -> list[list[np.ndarray]]:
        real = self.mask.numpy().astype(bool)
        return [[a[row][:, real[row]] for a in self.past] for row in range(real.shape[0])]


class _SlotsDriver:
    """Drives a slots graph as the server does: a row per sequence, prompts prefilled a chunk at a time (the
    chunk's logits kept at every position, so parity still sees them all), then every row decoding at once."""

    CHUNK = 5  # prompt tokens per step: every prompt of more than 5 tokens crosses a chunk boundary

    def __init__(self, runtime: DecoderRuntime, config, capacity: int):
        self.runtime, self.config, self.capacity = runtime, config, capacity
        self.argmax_rows = self.argmax_mismatches = 0  # the graph's greedy_tokens against its logits' argmax

    def _run(self, tokens, positions, chunk=(), start=0, slot=0, logits_index=()):
        width = int(max(positions.max(initial=0), 0)) + 1 if self.decoding else 1
        mask = (np.arange(width)[None, :] <= positions[:, None]).astype(np.int64)  # (B, W)
        sampled = self.runtime.run_slots(self.pool, tokens, positions, mask, np.asarray(chunk, np.int64), start, slot,
                                         np.asarray(logits_index, np.int64))
        self.argmax_rows += len(sampled.greedy_tokens)
        self.argmax_mismatches += int((sampled.greedy_tokens != sampled.logits.argmax(-1)).sum())
        return sampled.logits

    def prefill(self, prompts: list[list[int]]) -> list[np.ndarray]:
        rows = len(prompts)
        self.pool = self.runtime.new_pool(rows, self.config.n_kv_head, self.config.d_head, self.capacity)
        self.lengths = np.array([len(p) for p in prompts])
        self.decoding = False
        scratch_tokens, scratch = np.zeros(rows, np.int64), np.full(rows, self.capacity - 1, np.int64)
        logits = []
        for row, prompt in enumerate(prompts):
            pieces = []
            for start in range(0, len(prompt), self.CHUNK):
                chunk = prompt[start : start + self.CHUNK]
                pieces.append(self._run(scratch_tokens, scratch, chunk, start, row, rows + np.arange(len(chunk))))
            logits.append(np.concatenate(pieces))  # (L_r, V)
        return logits

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        self.decoding = True
        out = self._run(np.asarray(tokens, np.int64), self.lengths.copy(), logits_index=np.arange(len(tokens)))
        self.lengths += 1
        return out

    def kv(self) -> list[list[np.ndarray]]:
        return [self.pool.row_to_host(row, int(length)) for row, length in enumerate(self.lengths)]


def artifact_greedy(artifact_dir: str | Path, prompts: list[list[int]], steps: int, provider: str = "auto") -> np.ndarray:
    """The artifact's own greedy continuation of prompts, (B, steps): a slots artifact a row per prompt as the
    server runs it, a concat one as one left-padded batch, Optimum-style."""
    artifact = open_artifact(artifact_dir)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, provider)
    return greedy_tokens(_driver(runtime, artifact), prompts, steps)


def _driver(runtime: DecoderRuntime, artifact):
    if artifact.kv_cache == io.SLOTS:
        return _SlotsDriver(runtime, artifact.config, pool_capacity(artifact.config))
    return _ConcatDriver(runtime, artifact.config)


class _Verification:
    """One verify run: the artifact's driver and the eager reference fed the same prompts, check by check."""

    def __init__(self, artifact, reference: Decoder, runtime: DecoderRuntime, steps: int):
        self.artifact, self.reference, self.runtime, self.steps = artifact, reference, runtime, steps
        self.config = artifact.config
        self.tolerance = TOLERANCES[artifact.precision]
        self.driver = _driver(runtime, artifact)
        self.rng = np.random.default_rng(0)
        self.max_prompt = max(1, min(33, self.config.n_ctx - steps - 1))
        self.kv_max = np.zeros((self.config.n_layer, self.config.n_kv_head))  # (L, H_kv): worst over every check

    def prompts_of(self, lengths) -> list[list[int]]:
        return [self.rng.integers(0, self.config.vocab_size, min(n, self.max_prompt)).tolist() for n in lengths]

    def eager_prefill(self, prompts):
        ids, mask = left_pad(prompts)  # (B, T)
        pos = position_ids_from_mask(mask)
        logits, present = self.reference(ids, mask, pos, self.reference.empty_cache(len(prompts)))
        return logits, present, mask, pos

    def kv_check(self, check: _Check, eager_present, real: np.ndarray) -> CheckResult:
        divergence = _kv_divergence(self.driver.kv(), eager_present, real, self.tolerance.kv_relative)  # (L, H_kv)
        check.kv_max_abs = float(divergence.max())
        self.kv_max = np.maximum(self.kv_max, divergence)
        return check.result(self.tolerance)

    def prefill(self) -> list[CheckResult]:
        """Batches of several prompt lengths from an empty cache, every real position compared."""
        results = []
        for lengths in PREFILL_CASES:
            check = _Check(f"prefill B={len(lengths)} T={','.join(str(min(n, self.max_prompt)) for n in lengths)}")
            prompts = self.prompts_of(lengths)
            eager_logits, eager_present, mask, _ = self.eager_prefill(prompts)
            real = mask.numpy().astype(bool)
            check.add_logits(np.concatenate(self.driver.prefill(prompts)), eager_logits.numpy()[real])
            results.append(self.kv_check(check, eager_present, real))
        return results

    def decode_and_recompute(self) -> list[CheckResult]:
        """Cached decode steps, both sides fed the eager model's greedy tokens; then the cached path's last logits
        against one prefill over the whole sequence."""
        check = _Check(f"decode {self.steps} steps B={len(DECODE_PROMPTS)}")
        prompts = self.prompts_of(DECODE_PROMPTS)
        eager_logits, eager_past, mask, pos = self.eager_prefill(prompts)
        onnx_last = np.stack([row[-1] for row in self.driver.prefill(prompts)])  # (B, V)
        sequences = [list(p) for p in prompts]
        for _ in range(self.steps):
            token = eager_logits[:, -1].argmax(-1)  # (B,)
            for row, t in enumerate(token.tolist()):
                sequences[row].append(t)
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            eager_logits, eager_past = self.reference(token[:, None], mask, pos, eager_past)
            onnx_last = self.driver.decode(token.numpy())
            check.add_logits(onnx_last, eager_logits[:, -1].numpy())
        decode = self.kv_check(check, eager_past, mask.numpy().astype(bool))
        recompute = _Check("cached vs full recompute")
        full = self.driver.prefill(sequences)  # prompt + every fed token: the inputs behind onnx_last
        recompute.add_logits(onnx_last, np.stack([row[-1] for row in full]))
        return [decode, recompute.result(self.tolerance)]

    def greedy(self) -> GreedyResult:
        """ONNX Runtime's own greedy loop against the eager reference's tokens."""
        prompts = self.prompts_of(GREEDY_PROMPTS)
        eager = generate(self.reference, prompts, self.steps).tokens.numpy()
        onnx = greedy_tokens(self.driver, prompts, self.steps)  # (B, N)
        return GreedyResult(self.steps, bool(np.array_equal(onnx, eager)), onnx.tolist(), eager.tolist())

    def text(self) -> dict | None:
        """Quantized artifacts: teacher-forced held-out text (quality.py), held to the precision's text bounds."""
        bound = self.tolerance.text
        if bound is None:
            return None
        windows = eval_windows(load_tokenizer(self.artifact.tokenizer_path).encode, self.config.vocab_size, self.config.n_ctx)
        text = text_quality(self.driver, self.reference, windows)
        # A model that has not learned the text (random preset weights: perplexity near its vocabulary's size) spreads
        # its probability nearly evenly, so its argmax, its greedy path and its perplexity move with any rounding:
        # there only KL, which weighs each token by its probability, is held; the rest is reported.
        text["learned"] = bool(text["perplexity_eager"] <= LEARNED_PERPLEXITY_SHARE * self.config.vocab_size)
        text["passed"] = bool(text["kl_mean"] <= bound.kl_mean_max and (not text["learned"] or (
            text["top1_agreement"] >= bound.top1_min and text["perplexity_ratio"] <= bound.perplexity_ratio_max
            and np.mean(text["greedy_prefix"]) >= bound.greedy_prefix_min)))
        return text

    def argmax(self) -> ArgmaxResult | None:
        """Every slots step the checks above ran: the graph's greedy_tokens against its logits' argmax."""
        return ArgmaxResult(self.driver.argmax_rows, self.driver.argmax_mismatches) if self.driver.argmax_rows else None

    def first_failing_layer_head(self) -> LayerHead | None:
        over = np.argwhere(self.kv_max > self.tolerance.kv_max_abs)
        if not len(over):
            return None
        layer, head = (int(x) for x in over[0])  # argwhere is row-major: lowest layer, then lowest head
        return LayerHead(layer, head, float(self.kv_max[layer, head]))


def _failures(report: ParityReport, precision: str) -> list[str]:
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


@torch.no_grad()
def verify(artifact_dir: str | Path, reference: Decoder, provider: str = "auto", steps: int = 8) -> ParityReport:
    """Run every check; return the report (see format_report). Never raises on a parity failure."""
    artifact = open_artifact(artifact_dir)
    config = artifact.config
    if reference.config != config:
        raise ArtifactError(f"{artifact.directory}: the reference checkpoint's config differs from the artifact's config.json")
    most_steps = config.n_ctx - max(DECODE_PROMPTS) - 1  # the decode check feeds its longest prompt this many tokens
    if not 1 <= steps <= most_steps:
        raise VerifyRefused(f"--steps must be in [1, {most_steps}] for this model (context {config.n_ctx}), got {steps}")
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider)
    problems = contract_problems(runtime.signature(), artifact)
    if problems:  # e.g. an artifact from a kvserve whose graph for this layout differed: driving it would fail midway
        raise VerifyRefused(f"{artifact.directory}: the graph is not the contract its manifest declares ({'; '.join(problems[:2])}); re-export it")
    run = _Verification(artifact, reference.float().eval(), runtime, steps)
    with stage(f"parity: prefill and decode checks on {runtime.provider}"):
        checks = run.prefill() + run.decode_and_recompute()
    with stage("parity: greedy generation"):
        greedy = run.greedy()
    with stage("parity: held-out text") if run.tolerance.text is not None else contextlib.nullcontext():
        text = run.text()
    report = ParityReport(
        artifact=str(artifact.directory), dtype=artifact.dtype, quantization=artifact.quantization, kv_cache=artifact.kv_cache,
        attention=artifact.attention, provider=runtime.provider, provider_note=runtime.fallback_reason, tolerance=run.tolerance,
        checks=checks, greedy=greedy, text=text, greedy_tokens_argmax=run.argmax(),
        kv_max_abs_per_layer_head=run.kv_max.tolist(), first_failing_layer_head=run.first_failing_layer_head(),
    )
    report.failures = _failures(report, artifact.precision)
    return report


def format_report(report: ParityReport) -> str:
    """A markdown table of the checks, then the greedy, K/V and provider lines."""
    tol = report.tolerance
    relative = tol.logits_relative
    weights = f", {report.quantization} weights" if report.quantization else ""
    lines = [
        f"parity: {report.artifact} ({report.dtype}{weights}, {report.kv_cache} KV cache"
        f"{', fused attention' if report.attention == 'fused' else ''}) on {report.provider}",
        "",
        f"| check | max abs Δ logits{' (of max abs logit)' if relative else ''} | mean abs Δ logits | top-1 agree | mean KL | "
        f"{'rel. ' if tol.kv_relative else ''}max abs Δ K/V | ok |",
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
    lines.append("present K/V max abs Δ per layer (worst head): "
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
                 + (f"layer {bad.layer}, head {bad.head} (max abs Δ {bad.max_abs:.2e})" if bad else "none"))
    lines.append(
        f"tolerance ({report.quantization or report.dtype}): logits {tol.logits_max_abs:g}{' (relative)' if relative else ''}, "
        f"K/V {tol.kv_max_abs:g}{' (relative)' if tol.kv_relative else ''}, top-1 >= {tol.top1_min:g}"
        + (f", mean KL <= {tol.kl_mean_max:g}" if tol.kl_mean_max is not None else "")
        + f", greedy identical {'required' if tol.greedy_identical else 'reported'}"
    )
    if tol.text is not None:
        t = tol.text
        lines.append(f"held-out text tolerance: top-1 >= {t.top1_min:g}, mean KL <= {t.kl_mean_max:g}, "
                     f"perplexity ratio <= {t.perplexity_ratio_max:g}, mean greedy prefix >= {t.greedy_prefix_min}")
    if report.provider != "CUDAExecutionProvider":
        lines.append(f"note: ran on the CPU provider, not CUDA{f' ({report.provider_note})' if report.provider_note else ''}")
    lines.append(f"result: {'PASS' if report.passed else 'FAIL: ' + '; '.join(report.failures)}")
    return "\n".join(lines)


def write_report(report: ParityReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
