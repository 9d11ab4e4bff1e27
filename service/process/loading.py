"""Bringing a model up for serving: the artifact (only the slots layout is served), the session, the load-time
parity gate, the serving batch (its K/V pool reserved; on the CPU provider committed as tokens are written) and a
warm-up through the serving path. The gate, the warm-up (which captures the CUDA graphs) and every later step run on one step thread: a graph
captured on another thread would not be replayed by the steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.contract.artifact import Artifact, open_artifact, prefetch_checksums
from kvserve.contract.chat import ChatTemplate, load_chat_template
from kvserve.contract.config import DecoderConfig
from kvserve.contract.io_contract import SLOTS
from kvserve.contract.tokenizer import Tokenizer, load_tokenizer
from kvserve.errors import JobFailed, UserError
from kvserve.runtime import DecoderRuntime, ModelUnloadable, StepRunFailed

from ..core.batch import SlotBatch
from .gate import run_gate, warm_up
from ..core.model_info import GateResult
from .kv_budget import default_budget
from .options import ServerOptions
from ..core.scheduler import step_thread

log = logging.getLogger("kvserve.server")


class ParityGateFailed(JobFailed):
    """The artifact failed the load-time gate and the override was not given."""


class NotServable(UserError):
    """An artifact in a layout the server does not serve; the message says how to re-export it."""


def open_servable(path: str) -> Artifact:
    """The artifact at path, checked (its weights file's checksum is left to load_model, which checks it while the
    session opens), if the server serves its layout (slots)."""
    prefetch_checksums(path)  # the server's command started this before its imports; a no-op then
    artifact = open_artifact(path, weights_later=True)
    if artifact.kv_cache != SLOTS:
        raise NotServable(f"{path}: its {artifact.kv_cache} KV cache is an export for tools that drive the graph themselves; "
                          f"kvserve serves the {SLOTS} layout: re-export with kvserve export (without --kv-cache {artifact.kv_cache})")
    return artifact


def served_config(config: DecoderConfig, max_context: int | None) -> DecoderConfig:
    """The model's config as the server runs it: its context cut to max_context tokens a sequence."""
    if max_context is None:
        return config
    if not 2 <= max_context <= config.n_ctx:
        raise UserError(f"--max-context must be in [2, {config.n_ctx}] (the model's context), got {max_context}")
    return dataclasses.replace(config, n_ctx=max_context)


@dataclass
class LoadedModel:
    config: DecoderConfig  # as served: its context may be cut (max_context)
    runtime: DecoderRuntime
    gate: GateResult
    batch: SlotBatch  # warmed up, empty
    kv_budget: int  # bytes the K/V rows and the prompt cache may take (serve --kv-cache-memory or the default share)
    tokenizer: Tokenizer
    steps: ThreadPoolExecutor  # the one thread every step runs on
    chat_template: ChatTemplate | None  # the artifact's, if it has one


async def load_model(options: ServerOptions, artifact: Artifact, on_session=lambda runtime: None) -> LoadedModel:
    """Open the session for artifact, run the parity gate, then allocate the serving batch and warm it up.
    on_session(runtime) is told the session as soon as it is open (the server reports its provider)."""
    config = served_config(artifact.config, options.max_context)
    # Read first: a tokenizer or chat template that cannot be read is named before the minutes a large session takes
    tokenizer, chat_template = load_tokenizer(artifact.tokenizer_path), load_chat_template(artifact.directory)
    try:  # the weights file's hash (prefetch_checksums' thread) runs beside the session's repacking of the same bytes
        runtime = await asyncio.to_thread(DecoderRuntime, artifact.model_path, config.n_layer, artifact.dtype, options.provider,
                                          cuda_graph=options.cuda_graph, chunk_graph=options.split_steps)
    except ModelUnloadable:  # a weights file changed since export is the cause to name (not on Ctrl-C or a missing provider)
        await asyncio.to_thread(artifact.check_unchecked)
        raise
    await asyncio.to_thread(artifact.check_unchecked)  # before any step reads them
    if runtime.fallback_reason:
        log.warning("serving on the CPU provider: %s", runtime.fallback_reason)
    if runtime.cuda_graph_note:
        log.warning("%s", runtime.cuda_graph_note)
    log.info("execution provider: %s", runtime.provider)
    if runtime.splits_steps:
        log.info("steps with a prompt chunk beside decoding rows run the artifact's chunk graph, every other step its decode graph")
    elif runtime.chunkless_session is not None:
        log.info("steps of one row run the artifact's decode graph (small weights: a second session, on the same threads)")
    on_session(runtime)
    steps = step_thread()
    loop = asyncio.get_running_loop()
    budget = options.limits.step_token_budget
    try:
        gate = await loop.run_in_executor(steps, run_gate, runtime, artifact, budget)
        if not gate.passed:
            if not options.allow_parity_failure:
                raise ParityGateFailed(f"parity gate failed, refusing to serve {options.artifact}: {gate.summary}")
            log.error("!!! PARITY GATE FAILED, SERVING ANYWAY (--allow-parity-failure): %s", gate.summary)
            gate = GateResult(False, gate.summary, overridden=True)
        else:
            log.info("parity gate passed: %s", gate.summary)
        kv_budget = options.kv_cache_memory if options.kv_cache_memory is not None else default_budget()
        batch = await loop.run_in_executor(steps, SlotBatch, runtime, config, options.limits.max_batch_size)  # its K/V's address space
        await loop.run_in_executor(steps, warm_up, batch, artifact, budget, kv_budget)
    except BaseException as exc:
        steps.shutdown(wait=False)  # a failed load leaves no thread behind
        if isinstance(exc, StepRunFailed):  # a graph this provider cannot run (a kernel refusing its inputs): the artifact's fault
            raise ModelUnloadable(f"{options.artifact}: its graph does not run here ({exc}); export it again with this kvserve, "
                                  f"or serve it on another provider") from None
        raise
    if runtime.captures_decode:
        log.info("decode steps run as CUDA graphs: %d shapes captured", len(runtime.fixed_shapes(batch.pool)))
    return LoadedModel(config, runtime, gate, batch, kv_budget, tokenizer, steps, chat_template)
