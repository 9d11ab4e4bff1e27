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

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from kvserve.errors import UserError
from kvserve.model.generate import generate, left_pad, position_ids_from_mask
from kvserve.model.decoders import Decoder
from kvserve.service.gate import contract_problems
from kvserve.service.kv_slots import pool_capacity
from kvserve.service.runtime import DecoderRuntime

from .artifact import ArtifactError, open_artifact
from . import io_contract as io
from .quality import eval_windows, greedy_tokens, text_quality
from .tolerances import TOLERANCES, Tolerance, kl_divergence, logits_bound


class VerifyRefused(UserError):
    """verify was asked for something this artifact cannot be checked with; nothing ran."""


PREFILL_CASES = ((1,), (17,), (5, 12), (1, 8, 16, 33))  # prompt lengths, one per batch row
DECODE_PROMPTS = (7, 13)
GREEDY_PROMPTS = (5, 9)


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

    def result(self, tolerance: Tolerance) -> dict:
        top1 = self.agree / self.positions
        kl_mean = self.kl_sum / self.positions
        passed = self.max_abs <= logits_bound(tolerance, np.array(self.eager_max_abs)) and top1 >= tolerance.top1_min
        passed = passed and (self.kv_max_abs is None or self.kv_max_abs <= tolerance.kv_max_abs)
        passed = passed and (tolerance.kl_mean_max is None or kl_mean <= tolerance.kl_mean_max)
        return {
            "name": self.name,
            "max_abs_logits": self.max_abs,
            "max_abs_eager_logit": self.eager_max_abs,
            "mean_abs_logits": self.sum_abs / self.count,
            "top1_agreement": top1,
            "kl_mean": kl_mean,
            "kv_max_abs": self.kv_max_abs,
            "passed": passed,
        }


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
        logits, *self.past = self.runtime.session.run(None, feeds)
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


@torch.no_grad()
def verify(artifact_dir: str | Path, reference: Decoder, provider: str = "auto", steps: int = 8) -> dict:
    """Run every check; return the report (see format_report). Never raises on a parity failure."""
    artifact = open_artifact(artifact_dir)
    config = artifact.config
    if reference.config != config:
        raise ArtifactError(f"{artifact.directory}: the reference checkpoint's config differs from the artifact's config.json")
    most_steps = config.n_ctx - max(DECODE_PROMPTS) - 1  # the decode check feeds its longest prompt this many tokens
    if not 1 <= steps <= most_steps:
        raise VerifyRefused(f"--steps must be in [1, {most_steps}] for this model (context {config.n_ctx}), got {steps}")
    reference = reference.float().eval()
    tolerance = TOLERANCES[artifact.precision]
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider)
    problems = contract_problems(runtime, artifact)
    if problems:  # e.g. an artifact from a kvserve whose graph for this layout differed: driving it would fail midway
        raise VerifyRefused(f"{artifact.directory}: the graph is not the contract its manifest declares ({'; '.join(problems[:2])}); re-export it")
    rng = np.random.default_rng(0)
    max_prompt = max(1, min(33, config.n_ctx - steps - 1))
    driver = _driver(runtime, artifact)
    checks: list[dict] = []
    kv_max = np.zeros((config.n_layer, config.n_kv_head))

    def prompts_of(lengths) -> list[list[int]]:
        return [rng.integers(0, config.vocab_size, min(n, max_prompt)).tolist() for n in lengths]

    def eager_prefill(prompts):
        ids, mask = left_pad(prompts)  # (B, T)
        pos = position_ids_from_mask(mask)
        logits, present = reference(ids, mask, pos, reference.empty_cache(len(prompts)))
        return logits, present, mask, pos

    # prefill: batches of several prompt lengths, every real position compared
    for lengths in PREFILL_CASES:
        check = _Check(f"prefill B={len(lengths)} T={','.join(str(min(n, max_prompt)) for n in lengths)}")
        prompts = prompts_of(lengths)
        eager_logits, eager_present, mask, _ = eager_prefill(prompts)
        real = mask.numpy().astype(bool)
        onnx_logits = driver.prefill(prompts)
        check.add_logits(np.concatenate(onnx_logits), eager_logits.numpy()[real])
        divergence = _kv_divergence(driver.kv(), eager_present, real, tolerance.kv_relative)
        check.kv_max_abs = float(divergence.max())
        kv_max = np.maximum(kv_max, divergence)
        checks.append(check.result(tolerance))

    # decode: cached steps, both sides fed the eager model's greedy tokens
    check = _Check(f"decode {steps} steps B={len(DECODE_PROMPTS)}")
    prompts = prompts_of(DECODE_PROMPTS)
    eager_logits, eager_past, mask, pos = eager_prefill(prompts)
    onnx_last = np.stack([row[-1] for row in driver.prefill(prompts)])  # (B, V)
    sequences = [list(p) for p in prompts]
    for _ in range(steps):
        token = eager_logits[:, -1].argmax(-1)  # (B,)
        for row, t in enumerate(token.tolist()):
            sequences[row].append(t)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
        pos = pos[:, -1:] + 1  # (B, 1)
        eager_logits, eager_past = reference(token[:, None], mask, pos, eager_past)
        onnx_last = driver.decode(token.numpy())
        check.add_logits(onnx_last, eager_logits[:, -1].numpy())
    divergence = _kv_divergence(driver.kv(), eager_past, mask.numpy().astype(bool), tolerance.kv_relative)
    check.kv_max_abs = float(divergence.max())
    kv_max = np.maximum(kv_max, divergence)
    checks.append(check.result(tolerance))

    # recompute: the cached path's last logits against one prefill over the whole sequence
    check = _Check("cached vs full recompute")
    full = driver.prefill(sequences)  # prompt + every fed token: the inputs behind onnx_last
    check.add_logits(onnx_last, np.stack([row[-1] for row in full]))
    checks.append(check.result(tolerance))

    # greedy: ONNX Runtime's own loop against the eager reference's tokens
    greedy_prompts = prompts_of(GREEDY_PROMPTS)
    eager_tokens = generate(reference, greedy_prompts, steps).tokens.numpy()
    onnx_tokens = greedy_tokens(driver, greedy_prompts, steps)  # (B, N)
    greedy_identical = bool(np.array_equal(onnx_tokens, eager_tokens))

    text = None
    if tolerance.text is not None:
        from kvserve.service.text import load_tokenizer

        encode = load_tokenizer(artifact.tokenizer_path).encode
        windows = eval_windows(encode, config.vocab_size, config.n_ctx)
        text = text_quality(driver, reference, windows)
        bound = tolerance.text
        text["passed"] = bool(
            text["top1_agreement"] >= bound.top1_min and text["kl_mean"] <= bound.kl_mean_max
            and text["perplexity_ratio"] <= bound.perplexity_ratio_max and np.mean(text["greedy_prefix"]) >= bound.greedy_prefix_min
        )

    precision = artifact.precision
    failures = [f"{c['name']}: outside {precision} tolerance" for c in checks if not c["passed"]]
    if text is not None and not text["passed"]:
        failures.append(f"held-out text: outside {precision} tolerance")
    if tolerance.greedy_identical and not greedy_identical:
        failures.append("greedy tokens differ from the eager reference")
    argmax = None
    if driver.argmax_rows:
        argmax = {"rows": driver.argmax_rows, "mismatches": driver.argmax_mismatches}
        if driver.argmax_mismatches:
            failures.append(f"the graph's greedy_tokens differ from its logits' argmax at {driver.argmax_mismatches} of {driver.argmax_rows} rows")
    first_bad = None
    over = np.argwhere(kv_max > tolerance.kv_max_abs)
    if len(over):
        layer, head = (int(x) for x in over[0])  # argwhere is row-major: lowest layer, then lowest head
        first_bad = {"layer": layer, "head": head, "max_abs": float(kv_max[layer, head])}
        failures.append(f"present K/V first breaks tolerance at layer {layer}, head {head}")
    return {
        "artifact": str(artifact.directory),
        "dtype": artifact.dtype,
        "quantization": artifact.quantization,
        "kv_cache": artifact.kv_cache,
        "attention": artifact.attention,
        "provider": runtime.provider,
        "provider_note": runtime.fallback_reason,
        "tolerance": asdict(tolerance),
        "checks": checks,
        "greedy": {"steps": steps, "identical": greedy_identical, "onnx": onnx_tokens.tolist(), "eager": eager_tokens.tolist()},
        "text": text,
        "greedy_tokens_argmax": argmax,
        "kv_max_abs_per_layer_head": kv_max.tolist(),
        "first_failing_layer_head": first_bad,
        "failures": failures,
        "passed": not failures,
    }


def format_report(report: dict) -> str:
    """A markdown table of the checks, then the greedy, K/V and provider lines."""
    relative = report["tolerance"].get("logits_relative", False)
    lines = [
        f"parity: {report['artifact']} ({report['dtype']}{', ' + report['quantization'] + ' weights' if report.get('quantization') else ''}, "
        f"{report.get('kv_cache', 'concat')} KV cache{', fused attention' if report.get('attention') == 'fused' else ''}) on {report['provider']}",
        "",
        f"| check | max abs Δ logits{' (of max abs logit)' if relative else ''} | mean abs Δ logits | top-1 agree | mean KL | {'rel. ' if report['tolerance']['kv_relative'] else ''}max abs Δ K/V | ok |",
        "|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for c in report["checks"]:
        kv = "n/a" if c["kv_max_abs"] is None else f"{c['kv_max_abs']:.2e}"
        scale = f" (of {c['max_abs_eager_logit']:.3g})" if relative else ""
        lines.append(
            f"| {c['name']} | {c['max_abs_logits']:.2e}{scale} | {c['mean_abs_logits']:.2e} | "
            f"{c['top1_agreement']:.3f} | {c['kl_mean']:.1e} | {kv} | "
            f"{'yes' if c['passed'] else 'NO'} |"
        )
    greedy = report["greedy"]
    kv = np.array(report["kv_max_abs_per_layer_head"])
    lines += [
        "",
        f"greedy {greedy['steps']} steps: tokens {'identical' if greedy['identical'] else 'DIFFER'}",
    ]
    argmax = report.get("greedy_tokens_argmax")
    if argmax is not None:
        lines.append(f"greedy_tokens output vs its logits' argmax: {argmax['rows'] - argmax['mismatches']} of {argmax['rows']} rows equal")
    lines += [
        "present K/V max abs Δ per layer (worst head): "
        + ", ".join(f"L{i}={row.max():.1e} (h{int(row.argmax())})" for i, row in enumerate(kv)),
    ]
    text = report.get("text")
    if text is not None:
        lines.append(
            f"held-out text, teacher-forced ({text['positions']} positions): top-1 agree {text['top1_agreement']:.3f}, "
            f"mean KL {text['kl_mean']:.2e}, perplexity {text['perplexity_onnx']:.3f} vs eager {text['perplexity_eager']:.3f} "
            f"(x{text['perplexity_ratio']:.4f}); greedy prefix matching eager: {text['greedy_prefix']} of {text['greedy_steps']}"
        )
    bad = report["first_failing_layer_head"]
    lines.append(
        "first (layer, head) over tolerance: "
        + (f"layer {bad['layer']}, head {bad['head']} (max abs Δ {bad['max_abs']:.2e})" if bad else "none")
    )
    tol = report["tolerance"]
    lines.append(
        f"tolerance ({report.get('quantization') or report['dtype']}): logits {tol['logits_max_abs']:g}{' (relative)' if tol.get('logits_relative') else ''}, "
        f"K/V {tol['kv_max_abs']:g}{' (relative)' if tol['kv_relative'] else ''}, top-1 >= {tol['top1_min']:g}"
        + (f", mean KL <= {tol['kl_mean_max']:g}" if tol["kl_mean_max"] is not None else "")
        + f", greedy identical {'required' if tol['greedy_identical'] else 'reported'}"
    )
    if tol["text"] is not None:
        t = tol["text"]
        lines.append(
            f"held-out text tolerance: top-1 >= {t['top1_min']:g}, mean KL <= {t['kl_mean_max']:g}, "
            f"perplexity ratio <= {t['perplexity_ratio_max']:g}, mean greedy prefix >= {t['greedy_prefix_min']}"
        )
    if report["provider"] != "CUDAExecutionProvider":
        note = report.get("provider_note")
        lines.append(f"note: ran on the CPU provider, not CUDA{f' ({note})' if note else ''}")
    lines.append(f"result: {'PASS' if report['passed'] else 'FAIL: ' + '; '.join(report['failures'])}")
    return "\n".join(lines)


def write_report(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")
