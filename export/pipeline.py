"""`kvserve export`: checkpoint or preset -> a complete, verified artifact directory, or nothing at all.

Everything is written into a temporary directory beside the destination and renamed into place only after
the graph passed onnx.checker and the parity checks, so a failure never leaves a half-written artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch

import kvserve
from kvserve.contract import artifact as art
from kvserve.contract import io_contract as io
from kvserve.contract.config import LLAMA_ARCH, DecoderConfig
from kvserve.contract.hf_config import config_to_hf
from kvserve.errors import JobFailed, UserError
from kvserve.model.checkpoint import TOKENIZER_FILES, CheckpointWeights
from kvserve.model.decoders import Decoder, build
from kvserve.model.generate import generate
from kvserve.model.kv_storage import kv_stored_as
from kvserve.model.presets import preset
from kvserve.model.vocabulary import write_preset_tokenizer
from kvserve.model.weights import float32_bytes, reference_model, weight_source_of, weights_checksum
from kvserve.progress import stage
from kvserve.runtime import cuda_available, memory_limit
from kvserve.runtime.providers import planned_device

from .chunk_graph import save_chunk_graph, writes_chunk_graph
from .decode_graph import save_decode_graph, writes_decode_graph
from .graph_fusions import fuse_operators
from .kv_calibration import calibrate_int8_scales, calibration_windows
from .onnx_export import fused_attention_refusal, inplace_write_problems, save_graph, trace_streamed
from .parity import StepsFailed, format_report, verify, write_report
from .quantize import SCHEMES, QuantizeError, quantize_model
from .weight_plan import WeightPlan

GOLDEN_STEPS = 8


class ExportError(UserError):
    """Export refused before it started (bad source, destination taken); nothing was written."""


class ParityFailed(JobFailed):
    """The exported graph disagrees with the eager reference; nothing was left at the destination."""


def load_source(preset_name: str | None, checkpoint: str | Path | None, seed: int = 0) -> tuple[Decoder, dict]:
    """The eager model to export, and how to find it again (recorded in the manifest)."""
    if (preset_name is None) == (checkpoint is None):
        raise ExportError("give exactly one of --preset or --checkpoint")
    if preset_name is not None:
        try:
            config = preset(preset_name)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        return build(config, seed), {"kind": "preset", "name": preset_name, "seed": seed}
    checkpoint = Path(checkpoint).resolve()
    return reference_model(CheckpointWeights(checkpoint)), {"kind": "checkpoint", "path": str(checkpoint)}


def reference_for(artifact_dir: str | Path, checkpoint: str | Path | None = None) -> Decoder:
    """The eager model an artifact is verified against: the given checkpoint, else its recorded source."""
    manifest = art.open_artifact(artifact_dir, check_files=False).manifest
    if checkpoint is not None:
        return reference_model(CheckpointWeights(checkpoint))
    source = manifest["source"]
    if source["kind"] == "preset":
        return build(preset(source["name"]), source["seed"])
    if not Path(source["path"]).is_dir():
        raise ExportError(f"the source checkpoint {source['path']} is gone; pass --checkpoint DIR")
    return reference_model(CheckpointWeights(source["path"]))


def record_golden(model: Decoder) -> art.GoldenRecord:
    prompt = art.golden_prompt(model.config.vocab_size, length=min(12, model.config.n_ctx - GOLDEN_STEPS))
    result = generate(model, [prompt], GOLDEN_STEPS)
    return art.GoldenRecord(
        prompt_ids=np.array(prompt, dtype=np.int64),
        tokens=result.tokens[0].numpy().astype(np.int64),  # (N,)
        logits=result.step_logits[:, 0].numpy().astype(np.float32),  # (N, V)
    )


def quantize_graph(graph: onnx.ModelProto, scheme: str, n_layer: int, kv_cache: str, attention: str = io.STANDARD,
                   block_size: int | None = None, plan: WeightPlan | None = None, attention_bits: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """The graph with scheme's 8- or 4-bit weights (in blocks of block_size, or the scheme's default; an int4 graph's
    attention projections in attention_bits, 8 by default), and the manifest's facts about them; pending weights (plan)
    stay pending."""
    try:
        quantized, facts = quantize_model(graph, scheme, block_size, plan, attention_bits)
    except QuantizeError as exc:
        raise ExportError(str(exc)) from None
    if kv_cache == io.SLOTS:
        problems = inplace_write_problems(quantized.graph, n_layer, attention)
        if problems:
            raise RuntimeError("quantization broke the in-place KV write: " + "; ".join(problems[:3]))
    return quantized, facts


AUTO = "auto"
FINEST_BLOCK = 32  # llama.cpp's q4_0 and q8_0 share a scale over 32 weights


def _finer_blocks_hint(quantization: dict | None) -> str:
    """What to try when quantized weights moved the numbers past their bounds: blocks that follow the weights closer."""
    if not quantization or quantization.get("block_size", 0) <= FINEST_BLOCK:
        return ""
    return (f"\nquantized in blocks of {quantization['block_size']}: finer blocks follow the weights more closely, at some decode speed "
            f"(docs/parity.md, \"Block sizes\"): try --quantize-block {FINEST_BLOCK}")


def choose_attention(model: Decoder, kv_cache: str, dtype: str, provider: str, requested: str = AUTO, kv_dtype: str | None = None) -> str:
    """The slots graph's attention: what was asked for (refused by name when the model cannot have it), or for "auto"
    fused wherever it runs (GPT-2 and the Llama family, head_dim a multiple of 16, the slots cache), except a float32 graph that
    this machine would verify on CUDA, whose GroupQueryAttention kernel is float16 only there, and a float32 graph whose
    K/V are float16: ONNX Runtime 1.31's CPU kernel reads a float16 cache at a fifth of the standard graph's speed (gpt2
    int8 weights, 16 streams: 82 tokens/s against 271; bench/results/cpu-2core.md, "K/V dtypes")."""
    if requested not in (AUTO, *io.ATTENTIONS):
        raise ExportError(f"unknown attention {requested!r}; choose one of auto, {', '.join(io.ATTENTIONS)}")
    refusal = fused_attention_refusal(model, kv_cache) or rotary_tables_refusal(model.config)
    if requested == io.FUSED and refusal:
        raise ExportError(f"--attention fused: {refusal}")
    if requested != AUTO:
        return requested
    on_cuda = provider != "cpu" and cuda_available()
    float16_cache = dtype == "float32" and kv_dtype == "float16"
    return io.STANDARD if refusal or (dtype == "float32" and on_cuda) or float16_cache else io.FUSED


# The fused graph holds cos and sin of every position of the context (GroupQueryAttention indexes them by position), and
# tracing it holds a few float32 copies more: tables past this share of the process's memory (1.5 GB of 24 GB, a
# context of ~2.9 M positions at head_dim 128; Qwen2.5-1M's take 0.52 GB) are a standard graph's work, which turns each
# step's positions alone (10^8 positions at head_dim 16 went past a 4 GB memory limit tracing the tables).
ROTARY_TABLES_SHARE = 16


def rotary_tables_refusal(config: DecoderConfig) -> str | None:
    """Why the fused graph's rotary tables (float32, both of Gemma 3's bases) do not fit this machine, or None."""
    if config.architecture != LLAMA_ARCH:
        return None
    tables = (2 if config.local_rope_theta is not None else 1) * 2 * (config.n_ctx + 1) * (config.rotary_dim // 2) * 4
    limit = memory_limit()
    if tables * ROTARY_TABLES_SHARE <= limit:
        return None
    return (f"its context of {config.n_ctx:,} positions makes GroupQueryAttention's rotary tables (cos and sin of every position) "
            f"{tables / 1e9:.1f} GB, over 1/{ROTARY_TABLES_SHARE} of the {limit / 1e9:.1f} GB this process may use: --attention standard "
            "turns each step's positions alone")


# ONNX Runtime's CPU provider runs a float16 graph in float32: each session over it holds float32 copies of the weights
# beside the float16 file's mapped pages, about 3x the file. Measured: qwen3-0.6b's fused float16 export (1.2 GB of
# weights, two sessions: the step graph and its decode graph) peaked at 8.4 GB, its eager float32 model (2.4 GB) included;
# the Qwen3-4B shape's (8.0 GB) was killed past 21 GB in verify (2-core AMD EPYC Zen 5, docs/models.md).
CPU_FLOAT16_SESSION_FACTOR = 3


def cpu_float16_refusal(model: Decoder, dtype: str, kv_cache: str, attention: str, provider: str) -> str | None:
    """Why a float16 export cannot be verified on this machine's CPU (its memory), or None where it can or CUDA verifies it."""
    if dtype != "float16" or planned_device(provider) != "cpu":
        return None
    file_bytes = float32_bytes(weight_source_of(model)) // 2
    sessions = 2 if writes_decode_graph(dtype, kv_cache, attention, file_bytes) else 1
    need, limit = sessions * CPU_FLOAT16_SESSION_FACTOR * file_bytes, memory_limit()
    if need <= limit:
        return None
    return (f"--dtype float16: verifying {file_bytes / 1e9:.1f} GB of float16 weights on the CPU takes about {need / 1e9:.0f} GB "
            f"(ONNX Runtime computes float16 in float32 there, {sessions} session{'s' if sessions > 1 else ''}) and this process may use "
            f"{limit / 1e9:.1f} GB: export float16 on a machine whose GPU verifies it (--provider cuda), or --quantize int8 or int4 "
            f"for the CPU")


def remove_abandoned_staging(out: Path) -> None:
    """Delete the staging directories of earlier exports to out whose process is gone: an export killed outright (by the
    kernel's OOM killer, SIGKILL) cannot remove its own, and a large model's holds its whole weights file."""
    for staging in out.parent.glob(f".{out.name}.partial-*"):
        owner = staging.name.removeprefix(f".{out.name}.partial-").split("-", 1)[0]
        if not owner.isdigit():
            continue  # an older kvserve's staging names no process: left alone
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def export_artifact(
    model: Decoder,
    source: dict,
    out: str | Path,
    dtype: str = "float32",
    overwrite: bool = False,
    provider: str = "auto",
    tokenizer_dir: str | Path | None = None,
    kv_cache: str = io.DEFAULT_KV_CACHE,
    quantize: str | None = None,
    attention: str = AUTO,
    quantize_block: int | None = None,
    kv_dtype: str | None = None,
    attention_bits: int | None = None,
) -> dict:
    """Write a verified artifact to out; return the parity report. Raises ExportError, leaving out untouched. kv_dtype:
    what the slots graph's K/V pool holds (io_contract.KV_DTYPES; the model's dtype when None)."""
    out = Path(out).resolve()
    if kv_cache not in io.KV_CACHES:
        raise ExportError(f"unknown KV cache layout {kv_cache!r}; choose one of {', '.join(io.KV_CACHES)}")
    if quantize is not None and quantize not in SCHEMES:
        raise ExportError(f"unknown quantization {quantize!r}; choose one of: {', '.join(SCHEMES)}")
    if quantize is not None and dtype != "float32":
        raise ExportError(f"--quantize {quantize} quantizes a float32 graph's weights; drop --dtype {dtype}")
    if io.quantize_block_refusal(quantize, quantize_block):
        raise ExportError(io.quantize_block_refusal(quantize, quantize_block))
    if io.attention_bits_refusal(quantize, attention_bits):
        raise ExportError(io.attention_bits_refusal(quantize, attention_bits))
    if (refusal := io.kv_dtype_refusal(kv_dtype, dtype, kv_cache)) is not None:
        raise ExportError(refusal)
    kv_dtype = kv_dtype or dtype
    attention = choose_attention(model, kv_cache, dtype, provider, attention, kv_dtype)
    if (refusal := cpu_float16_refusal(model, dtype, kv_cache, attention, provider)) is not None:
        raise ExportError(refusal)
    if (refusal := art.replace_refusal(out, overwrite)) is not None:
        raise ExportError(refusal)
    if tokenizer_dir is not None:
        art.check_tokenizer_files(tokenizer_dir)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(out)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as exc:
        raise ExportError(f"{out}: cannot write there ({exc.strerror or exc})") from None
    try:
        model = model.float().eval()
        kv_scales, kv_quantization = None, None
        if kv_dtype == "int8":
            with stage("calibrate the int8 K/V scales"):
                tokenizer = Path(tokenizer_dir) / art.TOKENIZER_FILE if tokenizer_dir is not None else None
                windows, calibration = calibration_windows(model, tokenizer if tokenizer is not None and tokenizer.exists() else None,
                                                           from_text=source.get("kind") == "checkpoint")
                kv_scales = calibrate_int8_scales(model, windows)
            kv_quantization = {"scheme": "int8", "granularity": "a scale per layer, K/V head and channel", "calibration": calibration,
                               "file": art.KV_SCALES_FILE}
        with kv_stored_as(model, None if kv_dtype == dtype else kv_dtype, *(kv_scales or ())):
            return _export_verified(model, source, out, staging, dtype, provider, tokenizer_dir, kv_cache, quantize, attention,
                                    quantize_block, kv_dtype, kv_scales, kv_quantization, attention_bits)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _export_verified(model: Decoder, source: dict, out: Path, staging: Path, dtype: str, provider: str, tokenizer_dir, kv_cache: str,
                     quantize: str | None, attention: str, quantize_block: int | None, kv_dtype: str, kv_scales, kv_quantization,
                     attention_bits: int | None = None) -> dict:
    """export_artifact's work once its arguments hold, the model's cache storing K/V as kv_dtype: staging filled,
    verified and renamed to out."""
    weights = weight_source_of(model)
    with stage(f"trace the {kv_cache} graph ({dtype}, {attention} attention{'' if kv_dtype == dtype else f', {kv_dtype} K/V'})"):
        proto, graph, plan = trace_streamed(weights, dtype, kv_cache, attention, kv_dtype, kv_scales)
    with stage("fuse operators"):  # float16: its norms' float32 round trips made single operators first
        graph["fused_operators"] = fuse_operators(proto, float16=dtype == "float16", plan=plan)
    if quantize is not None:
        with stage(f"quantize the weights ({quantize})"):
            proto, graph["quantization"] = quantize_graph(proto, quantize, model.config.n_layer, kv_cache, attention, quantize_block, plan,
                                                          attention_bits)
            graph["fused_operators"] = graph["quantization"].pop("fused_operators")
    with stage("write the weights, check and save the graph"):
        graph["external_data"] = save_graph(proto, staging, plan)
    if writes_decode_graph(dtype, kv_cache, attention, art.graph_bytes(staging)):
        with stage("write the decode graph"):
            save_decode_graph(proto, staging)
    if writes_chunk_graph(dtype, kv_cache, attention):
        with stage("write the chunk graph"):
            save_chunk_graph(proto, staging)
    del proto, plan  # the weights are on disk now; verify loads the graph from there
    (staging / art.CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, staging / name)
    elif source.get("kind") == "preset":
        write_preset_tokenizer(source["name"], staging)  # gpt2: GPT-2's BPE; tiny: none (bytes)
    if kv_scales is not None:
        np.savez(staging / art.KV_SCALES_FILE, key=kv_scales[0].numpy(), value=kv_scales[1].numpy())  # (L, H_kv, d_k) each
    with stage("record the golden continuation"):
        record_golden(model).save(staging / art.GOLDEN_FILE)  # with K/V stored as the graph stores them
    files = sorted(p.name for p in staging.iterdir() if p.is_file())
    manifest = {
        "format": art.FORMAT,
        "dtype": dtype,
        "opset": graph["opset"],
        "ir_version": graph["ir_version"],
        "external_data": graph["external_data"],
        "inputs": graph["inputs"],
        "outputs": graph["outputs"],
        "kv_cache": kv_cache,
        "kv_ring": graph.get("kv_ring"),
        "kv_dtype": kv_dtype,
        "kv_quantization": kv_quantization,
        "attention": attention,
        "quantization": graph.get("quantization"),
        "fused_operators": graph.get("fused_operators", {}),
        "architecture": model.config.architecture,
        "model_type": model.config.model_type,
        "kv_heads": model.config.n_kv_head,
        "kv_layout": "(batch_size, num_key_value_heads, sequence, head_dim) per layer, key and value",
        "source": source,
        "weights_sha256": weights_checksum(weights),
        "files": {name: art.sha256_file(staging / name) for name in files},
        "golden": {"file": art.GOLDEN_FILE, "steps": GOLDEN_STEPS},
        "tokenizer": art.TOKENIZER_FILE if (staging / art.TOKENIZER_FILE).exists() else None,
        "versions": {"kvserve": kvserve.__version__, "torch": torch.__version__, "onnx": onnx.__version__},
        "created_unix": int(time.time()),
    }
    (staging / art.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    try:
        report = verify(staging, model, provider=provider)
    except StepsFailed as exc:  # named for the artifact, not the staging directory that goes with the failure
        raise StepsFailed(f"{out}: nothing written", exc.reason) from None
    if report.own_rounding is not None:  # the floor verify held the graph to: the load gate holds the served graph to it too
        manifest[art.OWN_ROUNDING_KEY] = report.own_rounding
        (staging / art.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    report.artifact = str(out)
    write_report(report, staging / art.PARITY_FILE)
    staging.chmod(0o755)  # mkdtemp makes it private; a serving container's non-root user must read it
    for path in staging.iterdir():
        path.chmod(0o644)  # onnx writes its external data file 0600; every file is as readable as the rest
    if not report.passed:
        raise ParityFailed("parity failed, nothing written:\n" + format_report(report) + _finer_blocks_hint(graph.get("quantization")))
    if out.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(retired / out.name)
        staging.rename(out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(out)
    return report
