"""Parity: the exported graph on ONNX Runtime against the eager reference, on the same weights.

Checks, each over real numbers from both sides:
  prefill    several batch sizes and prompt lengths (left-padded, or for the slots layout a row each, in
             chunks); logits and present K/V at every real position
  decode     cached single-token steps after a prefill, both sides fed the same tokens
  recompute  the cached decode's last logits against a full recompute of the whole sequence (past = 0)
  beside     slots graphs: decode steps with another row's prompt chunks beside them, as a joining prompt runs
  split      a fused float16 artifact's chunk graph and decode graph, every step split between them as CUDA serves
             it: decode, recompute and beside again
  greedy     ONNX Runtime's own greedy loop against the eager reference's tokens
  text       quantized artifacts only: teacher-forced held-out text (export/quality.py)
  argmax     slots graphs with greedy_tokens: that output equals its own logits' argmax at every row of every step
  long rope  longrope models: prefill and decode with every row turned by the long factors (a slots graph is told so;
             a concat graph turns a row long by its length, so it gets prompts past the original context when they
             fit the parity rows)
The present K/V divergence is kept per (layer, head), so a broken tolerance names where it starts (the K/V
heads: a grouped-query model's cache holds fewer heads than it has query heads).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvserve.contract.artifact import (CHUNK_GRAPH_FILE, DECODE_GRAPH_FILE, OWN_ROUNDING_KEY, ArtifactError, check_tokenizer_files,
                                      contract_problems, open_artifact)
from kvserve.contract.tokenizer import load_tokenizer
from kvserve.contract.tolerances import with_own_rounding
from kvserve.errors import JobFailed, UserError
from kvserve.model.decoders import Decoder
from kvserve.model.generate import generate, left_pad, position_ids_from_mask
from kvserve.model.kv_storage import kv_stored_as
from kvserve.progress import stage
from kvserve.runtime import DecoderRuntime, StepRunFailed

from .own_rounding import OwnRounding, own_rounding
from .parity_drivers import DRIVEN_COLUMNS, SlotsDriver, artifact_greedy, driver_for
from .parity_report import (
    ArgmaxResult,
    CheckResult,
    CheckStats,
    GreedyResult,
    LayerHead,
    ParityReport,
    failures_of,
    format_report,
    judged,
    kv_divergence,
    write_report,
)
from .quality import GREEDY_PROMPT_TOKENS, GREEDY_STEPS, WINDOW_TOKENS, eval_windows, greedy_tokens, text_quality

__all__ = ["ParityReport", "VerifyRefused", "artifact_greedy", "format_report", "verify", "write_report"]


class VerifyRefused(UserError):
    """verify was asked for something this artifact cannot be checked with; nothing ran."""


class StepsFailed(JobFailed):
    """verify ran the artifact's graph and ONNX Runtime failed one of its steps on the provider (reason: its message)."""

    def __init__(self, where: str | Path, reason: str):
        super().__init__(f"{where}: its graph fails a step ({reason})")
        self.reason = reason


PREFILL_CASES = ((1,), (17,), (5, 12), (1, 8, 16, 33))  # prompt lengths, one per batch row
DECODE_PROMPTS = (7, 13)
JOINING_PROMPT = 13  # the prompt that joins DECODE_PROMPTS' rows while they decode: 3 chunks of SlotsDriver.CHUNK
GREEDY_PROMPTS = (5, 9)
LONG_SLOTS_PROMPTS = (9, 17)  # a slots graph's long-rope check: every row told to turn long, whatever its length
# A model whose held-out perplexity is above this share of its vocabulary has not learned the text (the trained
# default model: 22 of 4,096; the random gpt2 preset: 57,000 of 50,257).
LEARNED_PERPLEXITY_SHARE = 0.1
# Prompt tokens a step of the held-out text's prefill (the prefill checks chunk by 5, crossing boundaries; this check reads
# logits only): gemma3-1b int8's text check took 44 s in chunks of 5.
TEXT_CHUNK = 64


def columns_needed(steps: int) -> int:
    """The most tokens a parity row holds over every check with steps decode steps: its K/V pool is sized to them (a
    Qwen3-4B shape's four rows of 2,049 columns took 2.4 GB of float32 K/V, of 129 columns 0.15 GB)."""
    return max(WINDOW_TOKENS, max(map(max, PREFILL_CASES)), max(DECODE_PROMPTS) + steps, max(GREEDY_PROMPTS) + steps,
               max(LONG_SLOTS_PROMPTS) + steps, GREEDY_PROMPT_TOKENS + GREEDY_STEPS)


class _Verification:
    """One verify run: the artifact's driver and the eager reference fed the same prompts, check by check."""

    def __init__(self, artifact, reference: Decoder, runtime: DecoderRuntime, steps: int):
        self.artifact, self.reference, self.runtime, self.steps = artifact, reference, runtime, steps
        self.config = artifact.config
        self.tolerance = artifact.tolerance
        self.driver = driver_for(runtime, artifact, columns_needed(steps))
        self.rng = np.random.default_rng(0)
        self.max_prompt = max(1, min(33, self.config.n_ctx - steps - 1))
        self.kv_max = np.zeros((self.config.n_layer, self.config.n_kv_head))  # (L, H_kv): worst over every check
        self.drawn: list[list[list[int]]] = []  # every batch of prompts the checks drew, in order

    def use_runtime(self, open_runtime: Callable[[], DecoderRuntime]) -> None:
        """Drive the runtime open_runtime opens from here on (the checks after it hold its graphs): the one driven so far,
        its pool and its sessions let go first."""
        argmax = self.driver.argmax_rows, self.driver.argmax_mismatches
        self.runtime = self.driver = None
        self.runtime = open_runtime()
        self.driver = driver_for(self.runtime, self.artifact, columns_needed(self.steps))
        self.driver.argmax_rows, self.driver.argmax_mismatches = argmax

    def prompts_of(self, lengths) -> list[list[int]]:
        prompts = [self.rng.integers(0, self.config.vocab_size, min(n, self.max_prompt)).tolist() for n in lengths]
        self.drawn.append(prompts)
        return prompts

    def eager_prefill(self, prompts, long=None):
        """long (B, 1) bool: longrope rows turned long whatever their length (Llama.forward)."""
        ids, mask = left_pad(prompts)  # (B, T)
        pos = position_ids_from_mask(mask)
        logits, present = self.reference(ids, mask, pos, self.reference.empty_cache(len(prompts)), *(() if long is None else (long,)))
        return logits, present, mask, pos

    def decode_alongside(self, check: CheckStats, eager_logits, eager_past, mask, pos, long=None):
        """self.steps cached decode steps after a prefill of both sides, each fed the eager model's greedy token, their
        logits compared in check: (eager's present, the mask, the driver's last logits (B, V), the tokens fed (B, steps))."""
        fed, onnx_last = [], None
        for _ in range(self.steps):
            token = eager_logits[:, -1].argmax(-1)  # (B,)
            fed.append(token)
            mask = torch.cat([mask, torch.ones(len(token), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            eager_logits, eager_past = self.reference(token[:, None], mask, pos, eager_past, *(() if long is None else (long,)))
            onnx_last = self.driver.decode(token.numpy())
            check.add_logits(onnx_last, eager_logits[:, -1].numpy())
        return eager_past, mask, onnx_last, torch.stack(fed, dim=1)

    def kv_check(self, check: CheckStats, eager_present, real: np.ndarray) -> CheckResult:
        divergence = kv_divergence(self.driver.kv(), eager_present, real, self.tolerance.kv_relative,
                                   self.tolerance.kv_rms)  # (L, H_kv)
        check.kv_max_abs = float(divergence.max())
        self.kv_max = np.maximum(self.kv_max, divergence)
        return check.result(self.tolerance)

    def prefill(self) -> list[CheckResult]:
        """Batches of several prompt lengths from an empty cache, every real position compared."""
        results = []
        for lengths in PREFILL_CASES:
            check = CheckStats(f"prefill B={len(lengths)} T={','.join(str(min(n, self.max_prompt)) for n in lengths)}")
            prompts = self.prompts_of(lengths)
            eager_logits, eager_present, mask, _ = self.eager_prefill(prompts)
            real = mask.numpy().astype(bool)
            check.add_logits(np.concatenate(self.driver.prefill(prompts)), eager_logits.numpy()[real])
            results.append(self.kv_check(check, eager_present, real))
        return results

    def decode_and_recompute(self) -> list[CheckResult]:
        """Cached decode steps, both sides fed the eager model's greedy tokens; then the cached path's last logits
        against one prefill over the whole sequence."""
        check = CheckStats(f"decode {self.steps} steps B={len(DECODE_PROMPTS)}")
        prompts = self.prompts_of(DECODE_PROMPTS)
        eager_logits, eager_past, mask, pos = self.eager_prefill(prompts)
        self.driver.prefill(prompts)
        eager_past, mask, onnx_last, fed = self.decode_alongside(check, eager_logits, eager_past, mask, pos)
        decode = self.kv_check(check, eager_past, mask.numpy().astype(bool))
        recompute = CheckStats("cached vs full recompute")
        full = self.driver.prefill([p + t for p, t in zip(prompts, fed.tolist())])  # prompt + every fed token: the inputs behind onnx_last
        recompute.add_logits(onnx_last, np.stack([row[-1] for row in full]))
        return [decode, recompute.result(self.tolerance)]

    def decode_graph(self) -> list[CheckResult]:
        """A fused artifact's decode graph (export/decode_graph.py), which serves its decode steps under CUDA graphs: the
        decode check again with every decode step through it."""
        check = CheckStats(f"decode graph {self.steps} steps B={len(DECODE_PROMPTS)}")
        prompts = self.prompts_of(DECODE_PROMPTS)
        eager_logits, eager_past, mask, pos = self.eager_prefill(prompts)
        self.driver.prefill(prompts)
        self.driver.fixed_decode = True
        try:
            eager_past, mask, _, _ = self.decode_alongside(check, eager_logits, eager_past, mask, pos)
        finally:
            self.driver.fixed_decode = False
        return [self.kv_check(check, eager_past, mask.numpy().astype(bool))]

    def rows_beside_chunk(self) -> list[CheckResult]:
        """Decode steps beside a prompt chunk, as a prompt joining a running batch runs (the step graph's chunk branch,
        and a fused artifact's chunk graph, which runs no other step): rows prefilled, then a row's prompt a chunk a step
        beside their decode steps, each fed the eager model's greedy token; every row's logits and K/V compared."""
        prompts = self.prompts_of(DECODE_PROMPTS + (JOINING_PROMPT,))
        decoding, joining = prompts[:-1], prompts[-1]
        steps = -(-len(joining) // self.driver.CHUNK)
        check = CheckStats(f"decode beside a prompt chunk: B={len(decoding)}, T={len(joining)} in {steps} steps")
        self.driver.prefill(decoding + [[]])
        long = joining_long = None  # a longrope model's rows keep the flags the driver gave them at prefill, both sides
        if self.config.long_rope_after is not None:
            long, joining_long = torch.from_numpy(self.driver.long[:-1].copy())[:, None], torch.tensor([[bool(self.driver.long[-1])]])  # (B, 1), (1, 1)
        eager_logits, eager_past, mask, pos = self.eager_prefill(decoding, long)
        joining_logits, joining_present, joining_mask, _ = self.eager_prefill([joining], joining_long)
        for start in range(0, len(joining), self.driver.CHUNK):
            token = eager_logits[:, -1].argmax(-1)  # (B,)
            mask = torch.cat([mask, torch.ones(len(token), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            eager_logits, eager_past = self.reference(token[:, None], mask, pos, eager_past, *(() if long is None else (long,)))
            rows, chunk = self.driver.decode_beside_chunk(token.numpy(), joining[start : start + self.driver.CHUNK])
            check.add_logits(rows, eager_logits[:, -1].numpy())
            check.add_logits(chunk, joining_logits[0, start : start + self.driver.CHUNK].numpy())
        onnx_rows = self.driver.kv()
        divergence = np.maximum(  # (L, H_kv): the decoding rows' and the joining row's
            kv_divergence(onnx_rows[:-1], eager_past, mask.numpy().astype(bool), self.tolerance.kv_relative, self.tolerance.kv_rms),
            kv_divergence(onnx_rows[-1:], joining_present, joining_mask.numpy().astype(bool), self.tolerance.kv_relative, self.tolerance.kv_rms))
        check.kv_max_abs = float(divergence.max())
        self.kv_max = np.maximum(self.kv_max, divergence)
        return [check.result(self.tolerance)]

    def one_row_steps(self) -> list[CheckResult]:
        """A small artifact's steps of one row, which its decode graph runs (runtime/step.py chunkless_steps; the other
        checks hold the step graph): a prompt prefilled a chunk at a time, then cached decode steps, as a request alone
        runs, every position's logits and the K/V compared."""
        prompts = self.prompts_of(DECODE_PROMPTS[-1:])
        check = CheckStats(f"decode graph, one row: prefill T={len(prompts[0])}, {self.steps} steps")
        eager_logits, eager_past, mask, pos = self.eager_prefill(prompts)
        check.add_logits(np.concatenate(self.driver.prefill(prompts)), eager_logits.numpy()[mask.numpy().astype(bool)])
        eager_past, mask, _, _ = self.decode_alongside(check, eager_logits, eager_past, mask, pos)
        return [self.kv_check(check, eager_past, mask.numpy().astype(bool))]

    def long_factors(self) -> list[CheckResult]:
        """A longrope model's long factors: prompts prefilled and decoded with every row turned long, against the eager
        model told the same. [] for other models, and for a concat graph whose original context is past the parity rows."""
        after = self.config.long_rope_after
        slots = isinstance(self.driver, SlotsDriver)
        if after is None or (not slots and after + 3 + self.steps > DRIVEN_COLUMNS):
            return []
        lengths = LONG_SLOTS_PROMPTS if slots else (after + 3, after + 1)
        prompts = [self.rng.integers(0, self.config.vocab_size, n).tolist() for n in lengths]
        check = CheckStats(f"long rope B={len(prompts)} T={','.join(map(str, lengths))}")
        long = torch.ones(len(prompts), 1, dtype=torch.bool)  # (B, 1)
        eager_logits, eager_past, mask, pos = self.eager_prefill(prompts, long)
        self.driver.long_rope = True
        try:
            check.add_logits(np.concatenate(self.driver.prefill(prompts)), eager_logits.numpy()[mask.numpy().astype(bool)])
            eager_past, mask, _, _ = self.decode_alongside(check, eager_logits, eager_past, mask, pos, long)
        finally:
            self.driver.long_rope = False
        return [self.kv_check(check, eager_past, mask.numpy().astype(bool))]

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
        chunks = self.driver.chunks_of(TEXT_CHUNK) if isinstance(self.driver, SlotsDriver) else contextlib.nullcontext()
        with kv_stored_as(self.reference, None), chunks:  # against float K/V: what K/V stored in fewer bits cost is held here
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

    def held_to_own_rounding(self, checks: list[CheckResult]) -> tuple[list[CheckResult], OwnRounding | None]:
        """Where a check fell outside the fixed bounds and the tolerance allows a floor: the eager model's own error in
        the artifact's dtype on the very prompts the checks drew (each batch decoding self.steps tokens after, each
        prompt again alone in the driver's chunks), and every check judged again against the tolerance raised to it
        (self.tolerance too, which names the first failing (layer, head))."""
        if self.tolerance.own_rounding_multiple is None or all(c.passed for c in checks):
            return checks, None
        with stage(f"parity: the eager model's own {self.artifact.dtype} error (a check is outside the fixed bounds)"):
            own = own_rounding(self.reference, self.drawn, self.steps, getattr(torch, self.artifact.dtype), SlotsDriver.CHUNK)
        if own is None:  # a streamed reference: the fixed bounds hold
            return checks, None
        self.tolerance = with_own_rounding(self.tolerance, own.logits, own.kv)
        return [judged(c, self.tolerance) for c in checks], own

    def first_failing_layer_head(self) -> LayerHead | None:
        over = np.argwhere(self.kv_max > self.tolerance.kv_max_abs)
        if not len(over):
            return None
        layer, head = (int(x) for x in over[0])  # argwhere is row-major: lowest layer, then lowest head
        return LayerHead(layer, head, float(self.kv_max[layer, head]))


@torch.no_grad()
def verify(artifact_dir: str | Path, reference: Decoder, provider: str = "auto", steps: int = 8) -> ParityReport:
    """Run every check; return the report (see format_report). Never raises on a parity failure; a graph whose steps
    ONNX Runtime fails on the provider (a kernel refusing its inputs) raises StepsFailed, the node named."""
    try:
        return _verify(artifact_dir, reference, provider, steps)
    except StepRunFailed as exc:
        raise StepsFailed(artifact_dir, str(exc)) from None


def _verify(artifact_dir: str | Path, reference: Decoder, provider: str, steps: int) -> ParityReport:
    artifact = open_artifact(artifact_dir)
    artifact.golden()  # what the server's gate replays and the text files it reads: a verdict on an artifact no server starts misleads
    check_tokenizer_files(artifact.directory)
    config = artifact.config
    if reference.config != config:
        raise ArtifactError(f"{artifact.directory}: the reference checkpoint's config differs from the artifact's config.json")
    most_steps = min(config.n_ctx, DRIVEN_COLUMNS) - max(DECODE_PROMPTS) - 1  # the decode check feeds its longest prompt this many tokens
    if not 1 <= steps <= most_steps:
        raise VerifyRefused(f"--steps must be in [1, {most_steps}] for this model (context {config.n_ctx}), got {steps}")
    has_decode_graph = (artifact.directory / DECODE_GRAPH_FILE).exists()
    runtime = DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider, decode_graph=has_decode_graph)
    problems = contract_problems(runtime.signature(), artifact)
    if problems:  # e.g. an artifact from a kvserve whose graph for this layout differed: driving it would fail midway
        raise VerifyRefused(f"{artifact.directory}: the graph is not the contract its manifest declares ({'; '.join(problems[:2])}); re-export it")
    scales = artifact.kv_scales()
    stores = None if artifact.kv_dtype == artifact.dtype else artifact.kv_dtype
    # The reference stores K/V as the artifact declares, with its recorded scales: the graph is held to that arithmetic
    # (a graph whose scale differs from the recorded one breaks the K/V check at its layer), the scales to the text check.
    with kv_stored_as(reference.float().eval(), stores, *(() if scales is None else (torch.from_numpy(s) for s in scales))):
        run = _Verification(artifact, reference, runtime, steps)
        one_row = runtime.chunkless_session is not None  # a small artifact's one-row steps run its decode graph
        with runtime.step_graph_only():  # every check below holds the step graph, which steps of several rows run
            with stage(f"parity: prefill and decode checks on {runtime.provider}"):
                checks = run.prefill() + run.decode_and_recompute() + run.long_factors() + (run.decode_graph() if has_decode_graph else [])
                checks += run.rows_beside_chunk() if isinstance(run.driver, SlotsDriver) else []
            with stage("parity: greedy generation"):
                greedy = run.greedy()
            with stage("parity: held-out text") if run.tolerance.text is not None else contextlib.nullcontext():
                text = run.text()
        if one_row:
            with stage("parity: the decode graph's one-row steps"):
                checks += run.one_row_steps()
        provider_used, provider_note = runtime.provider, runtime.fallback_reason
        if (artifact.directory / CHUNK_GRAPH_FILE).exists():
            with stage("parity: the chunk graph and the decode graph, every step split between them"):
                del runtime  # its sessions go before the split runtime's come: two at a time, as the export's memory check counts
                run.use_runtime(lambda: DecoderRuntime(artifact.model_path, config.n_layer, artifact.dtype, provider, chunk_graph=True))
                split = run.decode_and_recompute() + run.rows_beside_chunk()
                checks += [dataclasses.replace(c, name=f"split steps: {c.name}") for c in split]
    checks, own = run.held_to_own_rounding(checks)
    report = ParityReport(
        artifact=str(artifact.directory), dtype=artifact.dtype, quantization=artifact.quantization, kv_cache=artifact.kv_cache,
        attention=artifact.attention, provider=provider_used, provider_note=provider_note, tolerance=run.tolerance,
        checks=checks, greedy=greedy, text=text, greedy_tokens_argmax=run.argmax(),
        kv_max_abs_per_layer_head=run.kv_max.tolist(), first_failing_layer_head=run.first_failing_layer_head(),
        kv_dtype=stores, own_rounding=dataclasses.asdict(own) if own is not None else artifact.manifest.get(OWN_ROUNDING_KEY),
    )
    report.failures = failures_of(report, artifact.precision)
    return report
