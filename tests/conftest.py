"""Shared fixtures: tiny models and artifacts are built once per test session."""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The execution provider the tests serve and verify with: cpu everywhere (CI has no GPU); on a GPU host,
# KVSERVE_TEST_PROVIDER=cuda runs the same tests on the CUDA provider (bench/gpu_check.sh does).
PROVIDER = os.environ.get("KVSERVE_TEST_PROVIDER", "cpu")
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def json_strategies(max_text: int, max_leaves: int):
    """hypothesis strategies of the fuzz tests: (a JSON leaf of every awkward kind: null, booleans, integers past 64
    bits, NaN and infinities, short text; any JSON value of such leaves nested in lists and objects)."""
    from hypothesis import strategies as st

    big = 2**70
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-big, big), st.integers(-3, 300),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=max_text))
    nested = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                          max_leaves=max_leaves)
    return leaves, nested


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `kvserve ARGS` as a user would, capturing output."""
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="session")
def tiny_model():
    from kvserve.model.decoders import build
    from kvserve.model.presets import preset

    return build(preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_llama_model():
    from kvserve.model.decoders import build
    from kvserve.model.presets import preset

    return build(preset("tiny-llama"), seed=0)


# The dtypes a fused (GroupQueryAttention) graph is tested in: ONNX Runtime's CUDA kernel is float16 only, and the
# runtime refuses a float32 fused graph there, so under KVSERVE_TEST_PROVIDER=cuda only float16 runs.
FUSED_DTYPES = ("float32", "float16") if PROVIDER == "cpu" else ("float16",)


@pytest.fixture(scope="session")
def tiny_llama_fused_artifacts(tmp_path_factory, tiny_llama_model):
    """Factory, cached per session: dtype -> the tiny-llama preset exported as `kvserve export --preset tiny-llama
    --dtype DTYPE` writes it (slots, fused attention), verified on the tests' provider."""
    from kvserve.export.pipeline import export_artifact

    built = {}

    def make(dtype: str) -> Path:
        if dtype not in built:
            out = tmp_path_factory.mktemp("artifacts") / f"tiny-llama-{dtype}"
            export_artifact(tiny_llama_model, {"kind": "preset", "name": "tiny-llama", "seed": 0}, out, dtype=dtype, provider=PROVIDER,
                            attention="fused")
            built[dtype] = out
        return built[dtype]

    return make


@pytest.fixture(scope="session")
def tiny_llama_fused_artifact(tiny_llama_fused_artifacts) -> Path:
    """The tiny-llama fused artifact in the first of FUSED_DTYPES: float32 on the CPU, float16 under CUDA."""
    return tiny_llama_fused_artifacts(FUSED_DTYPES[0])


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_model) -> Path:
    """The tiny preset exported (float32) and verified, as `kvserve export --preset tiny` writes it: the
    default `slots` KV cache, the one the server runs best, with fused attention (GroupQueryAttention)."""
    from kvserve.export.pipeline import export_artifact

    out = tmp_path_factory.mktemp("artifacts") / "tiny"
    export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, out, provider=PROVIDER)
    return out


@pytest.fixture(scope="session")
def tiny_standard_artifact(tmp_path_factory, tiny_model) -> Path:
    """The tiny preset's slots graph with standard attention (`--attention standard`): ONNX ops, a ScatterND into the
    pool, the graph CUDA graphs capture."""
    from kvserve.export.pipeline import export_artifact

    out = tmp_path_factory.mktemp("artifacts") / "tiny-standard"
    export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, out, provider=PROVIDER, attention="standard")
    return out


@pytest.fixture(scope="session")
def tiny_fused_float16_artifact(tmp_path_factory, tiny_model) -> Path:
    """The tiny preset exported float16 with fused attention: a decode graph and a chunk graph beside its step graph,
    what CUDA serves."""
    from kvserve.export.pipeline import export_artifact

    out = tmp_path_factory.mktemp("artifacts") / "tiny-fused-float16"
    export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, out, dtype="float16", provider=PROVIDER, attention="fused")
    return out


@pytest.fixture(scope="session")
def tiny_fused_artifact(request, tiny_artifact) -> Path:
    """The tiny preset with fused attention in the first of FUSED_DTYPES: the default export on the CPU (tiny_artifact,
    float32), float16 under CUDA, whose GroupQueryAttention kernel has no float32 (there `auto` keeps float32 standard)."""
    if FUSED_DTYPES[0] == "float32":
        return tiny_artifact
    return request.getfixturevalue("tiny_fused_float16_artifact")


@pytest.fixture(scope="session")
def tiny_float16_artifact(tmp_path_factory, tiny_model) -> Path:
    """The tiny preset exported in float16 with standard attention (`kvserve export --preset tiny --dtype float16
    --attention standard`), verified with float16's tolerances: the precision and graph CUDA graphs capture on a GPU."""
    from kvserve.export.pipeline import export_artifact

    out = tmp_path_factory.mktemp("artifacts") / "tiny-float16"
    export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, out, dtype="float16", provider=PROVIDER, attention="standard")
    return out


@pytest.fixture(scope="session")
def tiny_concat_artifact(tmp_path_factory, tiny_model) -> Path:
    """The tiny preset with the concat KV cache (`kvserve export --kv-cache concat`): Optimum-style I/O."""
    from kvserve.export.pipeline import export_artifact

    out = tmp_path_factory.mktemp("artifacts") / "tiny-concat"
    export_artifact(tiny_model, {"kind": "preset", "name": "tiny", "seed": 0}, out, provider=PROVIDER, kv_cache="concat")
    return out


@pytest.fixture(scope="session")
def kv_dtype_artifacts(tmp_path_factory, tiny_model, tiny_llama_model):
    """Factory, cached per session: (preset, attention, kv_dtype) -> the preset ("tiny" or "tiny-llama") exported as
    `kvserve export --preset PRESET --attention ATTENTION --kv-dtype KV_DTYPE` writes it, verified on the tests' provider."""
    from kvserve.export.pipeline import export_artifact

    built = {}

    def make(name: str, attention: str, kv_dtype: str) -> Path:
        key = (name, attention, kv_dtype)
        if key not in built:
            model = tiny_model if name == "tiny" else tiny_llama_model
            out = tmp_path_factory.mktemp("artifacts") / f"{name}-{attention}-{kv_dtype}"
            export_artifact(model, {"kind": "preset", "name": name, "seed": 0}, out, provider=PROVIDER, attention=attention, kv_dtype=kv_dtype)
            built[key] = out
        return built[key]

    return make


def unrunnable_copy(artifact, destination):
    """The artifact with graphs that load and then fail every step: they read the rows to sample far past the step's
    tokens, as a kernel refusing its inputs on one provider would (a ring graph's empty sum under CUDA)."""
    import numpy as np
    import onnx

    from kvserve.contract.artifact import sha256_file

    shutil.copytree(artifact, destination)
    manifest = json.loads((destination / "manifest.json").read_text())
    for name in ("model.onnx", "decode.onnx"):  # the tiny artifacts' graphs: the step graph and the one-row steps' graph
        graph = onnx.load(destination / name)
        for node in graph.graph.node:  # every read of the rows to sample goes past the last token
            node.input[:] = ["far_index" if value == "logits_index" else value for value in node.input]
        graph.graph.initializer.append(onnx.numpy_helper.from_array(np.array(10**6, np.int64), "far"))
        graph.graph.node.insert(0, onnx.helper.make_node("Add", ["logits_index", "far"], ["far_index"]))
        onnx.save(graph, destination / name)
        manifest["files"][name] = sha256_file(destination / name)
    (destination / "manifest.json").write_text(json.dumps(manifest))
    return destination


DEFAULT_CHECKPOINT = REPO / "checkpoints" / "kjv-gpt2"  # the trained default model (model/train.py)
QUOTE_CHECKPOINT = REPO / "checkpoints" / "kjv-quote-gpt2"  # the default model trained on to quote its context


@pytest.fixture(scope="session")
def trained_model():
    from kvserve.model.checkpoint import load_checkpoint

    return load_checkpoint(DEFAULT_CHECKPOINT)


def _trained_quantized(tmp_path_factory, trained_model, scheme: str) -> Path:
    from kvserve.export.pipeline import export_artifact

    out = tmp_path_factory.mktemp("artifacts") / f"kjv-{scheme}"
    source = {"kind": "checkpoint", "path": str(DEFAULT_CHECKPOINT)}
    export_artifact(trained_model, source, out, provider=PROVIDER, tokenizer_dir=DEFAULT_CHECKPOINT, quantize=scheme)
    return out


@pytest.fixture(scope="session")
def trained_int8_artifact(tmp_path_factory, trained_model) -> Path:
    """The trained default model exported with `--quantize int8` (verified against the float32 eager model)."""
    return _trained_quantized(tmp_path_factory, trained_model, "int8")


@pytest.fixture(scope="session")
def trained_int4_artifact(tmp_path_factory, trained_model) -> Path:
    """The trained default model exported with `--quantize int4` (verified against the float32 eager model)."""
    return _trained_quantized(tmp_path_factory, trained_model, "int4")


@pytest.fixture(scope="session")
def make_hf_checkpoint(tmp_path_factory):
    """Factory: a transformers GPT2LMHeadModel with random weights from a config, saved locally."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def make(seed: int = 0, **config):
        torch.manual_seed(seed)
        config.setdefault("bos_token_id", config.get("vocab_size", 50257) - 1)
        config.setdefault("eos_token_id", config.get("vocab_size", 50257) - 1)
        hf = GPT2LMHeadModel(GPT2Config(**config)).eval()
        directory = tmp_path_factory.mktemp("hf-checkpoint")
        hf.save_pretrained(directory)
        return hf, directory

    return make


# Llama-family configs the tests hold kvserve to (transformers' own config classes, random weights). Together they
# cover grouped 2:1 and 4:1 and plain multi-head K/V, head_dim apart from hidden_size / heads and not 64,
# rope_theta 500000 with llama3 rope scaling, tied and untied LM heads, Q/K/V (and O, MLP) biases.
LLAMA_CONFIGS = {
    "llama gqa 2:1 llama3-rope tied": ("llama", dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=160, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )),
    # LongRoPE on a model transformers does not recompute the cache of at the crossing (only its Phi-3 does)
    "llama gqa 2:1 head_dim 32 longrope tied": ("llama", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 48,
                         "short_factor": [1.0 + 0.03 * i for i in range(16)], "long_factor": [1.2 + 0.5 * i for i in range(16)]},
    )),
    "llama gqa 4:1 head_dim 24 untied": ("llama", dict(
        vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        head_dim=24, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )),
    # dynamic NTK RoPE: transformers raises the base only past max_position_embeddings, so within it, plain RoPE
    "llama multi-head head_dim 40 biased dynamic-rope": ("llama", dict(
        vocab_size=256, hidden_size=80, intermediate_size=112, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=128, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )),
    "qwen2 gqa 3:1 qkv-bias tied": ("qwen2", dict(
        vocab_size=400, hidden_size=96, intermediate_size=144, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=1000000.0, tie_word_embeddings=True,
    )),
    "mistral gqa 2:1 head_dim 32 untied": ("mistral", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=128, sliding_window=None, tie_word_embeddings=False,
    )),
    "qwen3 gqa 2:1 head_dim 32 qk-norm yarn tied": ("qwen3", dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=160, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40},
    )),
    "qwen3 multi-head head_dim 16 qk-norm biased linear-rope untied": ("qwen3", dict(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
        head_dim=16, max_position_embeddings=128, attention_bias=True, tie_word_embeddings=False, use_sliding_window=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )),
    "mistral sliding window 7 head_dim 16": ("mistral", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=128, sliding_window=7, tie_word_embeddings=False,
    )),
    "qwen2 sliding window 5 from layer 1 of 3": ("qwen2", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, use_sliding_window=True, sliding_window=5, max_window_layers=1, tie_word_embeddings=True,
    )),
    # query_pre_attn_scalar apart from head_dim, and soft caps low enough to bite on these weights; Gemma scales its
    # embeddings by sqrt(hidden_size), so narrower weights than the others' keep its greedy tokens context-dependent
    "gemma2 gqa 2:1 head_dim 16 softcaps sliding 5": ("gemma2", dict(initializer_range=0.08,
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=128, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=8.0,
        final_logit_softcapping=12.0,
    )),
    # its attention cap set and low: transformers' Gemma 3 applies none (the field is kept, never handed to attention)
    "gemma3 multi-query head_dim 32 qk-norm two bases linear-rope sliding 6": ("gemma3_text", dict(initializer_range=0.08,
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=160, sliding_window=6, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )),
    # Phi-3.5's longrope (short factors within its original 64 positions, long ones past them, to the 128 it was stretched
    # to, and that stretch's attention factor) on Phi-4-mini's partial rotation (3/4 of each head turns)
    "phi3 gqa 2:1 head_dim 64 longrope partial 0.75 untied": ("phi3", dict(
        vocab_size=300, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=128, original_max_position_embeddings=64, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.05 * i for i in range(24)], "long_factor": [1.5 + 0.4 * i for i in range(24)]},
    )),
    "phi3 multi-head head_dim 16 sliding 6 tied": ("phi3", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, sliding_window=6, tie_word_embeddings=True, pad_token_id=0,
    )),
    # SmolLM3: every second layer (of 4) turns nothing, and slides
    "smollm3 gqa 2:1 head_dim 16 nope every 2nd sliding 5 tied": ("smollm3", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5, pad_token_id=0,
    )),
}


@pytest.fixture(scope="session")
def make_hf_llama(tmp_path_factory):
    """Factory: a transformers Llama-family model (Llama, Qwen2, Mistral, Qwen3, Gemma 2, Gemma 3, Phi-3 and SmolLM3 ForCausalLM) with random
    weights from a config, saved locally as save_pretrained writes it: optionally in bfloat16, optionally sharded.
    Returns the model in float32 (the reference: exactly the saved weights) and the directory."""
    import torch
    import transformers

    from .hf_reference import HF_CLASSES

    def make(model_type: str, seed: int = 0, dtype=None, max_shard_size=None, generation=None, **config):
        torch.manual_seed(seed)
        # Weights far wider than the 0.02 default: greedy tokens then depend on the context and win by clear margins
        # (at 0.02 a model this small repeats one token whatever it reads, and a token-for-token check proves little).
        config.setdefault("initializer_range", 0.3)
        config.setdefault("bos_token_id", 1)
        config.setdefault("eos_token_id", 2)
        config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[model_type])
        hf_config = config_class(**config, attn_implementation="eager")
        hf = model_class(hf_config).eval()
        with torch.no_grad():  # norms drawn around 1, not left at it: a norm applied in the wrong place then shows
            for name, param in hf.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.3)
        if dtype is not None:
            hf = hf.to(dtype)
        directory = tmp_path_factory.mktemp(f"hf-{model_type}")
        hf.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        if generation is not None:
            (directory / "generation_config.json").write_text(json.dumps(generation))
        if dtype is not None:  # read back in float32: hf.float() would keep rotary frequencies rounded to dtype
            hf = model_class.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
        return hf, directory

    return make


@pytest.fixture(scope="session")
def llama_artifact(tmp_path_factory, make_hf_llama):
    """Factory, cached per session: LLAMA_CONFIGS[name]'s transformers model saved as a checkpoint and exported from
    it (`kvserve export --checkpoint`, verified) with the given KV cache layout, dtype and attention (auto: fused where
    the model allows it). Returns (hf, checkpoint, artifact)."""
    from kvserve.export.pipeline import export_artifact
    from kvserve.model.checkpoint import load_checkpoint

    checkpoints, artifacts = {}, {}

    def make(name: str, kv_cache: str = "slots", dtype: str = "float32", attention: str = "auto"):
        if name not in checkpoints:
            model_type, config = LLAMA_CONFIGS[name]
            checkpoints[name] = make_hf_llama(model_type, seed=len(name), **config)
        hf, checkpoint = checkpoints[name]
        key = (name, kv_cache, dtype, attention)
        if key not in artifacts:
            out = tmp_path_factory.mktemp("llama-artifacts") / f"{kv_cache}-{dtype}-{attention}"
            source = {"kind": "checkpoint", "path": str(checkpoint)}
            export_artifact(load_checkpoint(checkpoint), source, out, dtype=dtype, provider=PROVIDER, kv_cache=kv_cache, attention=attention)
            artifacts[key] = out
        return hf, checkpoint, artifacts[key]

    return make


KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1, localhost and server, a client certificate it signed, and an unrelated
    CA; minted by openssl (`make system-tools` installs it)."""
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", *KEY, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=kvserve test {ca}")
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,DNS:server,IP:127.0.0.1\n")  # server: what nginx dials
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        run("req", *KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *ext)
    return d


# Chat templates that render tools, written here in the style of each family's own (nothing copied): the format a
# reply's calls take is the family's (service/core/tool_calls.py reads it from the template).
QWEN_TOOLS_STYLE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}
{{- '# Tools\n\nFunctions you may call:\n<tools>' }}{% for tool in tools %}{{ '\n' + tool | tojson }}{% endfor %}
{{- '\n</tools>\n\nCall one by writing its name and arguments as JSON between tags:\n<tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' or (message['role'] == 'assistant' and message.tool_calls is not defined) %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}
{%- for call in message.tool_calls %}{{ '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + '}\n</tool_call>' }}{% endfor %}
{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{%- if messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
LLAMA3_TOOLS_STYLE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{% if tools %}{{ 'Environment: ipython\n' }}{% endif %}{{ system + '<|eot_id|>' }}
{%- for message in turns %}
{%- if loop.first and tools %}
{{- '<|start_header_id|>user<|end_header_id|>\n\nTo use a function, answer with JSON alone: {"name": <function>, "parameters": <object of its arguments>}.\n\n' }}
{%- for tool in tools %}{{ tool | tojson(indent=4) + '\n\n' }}{% endfor %}{{ message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- for call in message['tool_calls'] %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}<|eot_id|>' }}{% endfor %}
{%- elif message['role'] == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}
{%- else %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""
MISTRAL_TOOLS_STYLE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}
{%- for message in turns %}
{%- if message['role'] == 'user' %}
{%- if loop.first and tools %}{{ '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}
{{- '[INST]' + (system if loop.first else '') + message['content'] + '[/INST]' }}
{%- elif message['role'] == 'assistant' and message.tool_calls is defined %}
{{- '[TOOL_CALLS][' }}{% for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('a tool call id is 9 letters or digits') }}{% endif %}
{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}{% if not loop.last %}{{ ', ' }}{% endif %}
{%- endfor %}{{ ']' + eos_token }}
{%- elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}
{%- elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS]' + {'content': message['content'], 'call_id': message['tool_call_id']} | tojson + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""
TOOL_TEMPLATES = {"hermes": QWEN_TOOLS_STYLE, "llama3_json": LLAMA3_TOOLS_STYLE, "mistral": MISTRAL_TOOLS_STYLE}


@pytest.fixture(scope="session")
def long_tiny_artifact(tmp_path_factory) -> Path:
    """The tiny preset with a 2,048-token context (a conversation with tools takes room), exported and verified once."""
    import dataclasses

    from kvserve.export.pipeline import export_artifact
    from kvserve.model.decoders import build
    from kvserve.model.presets import preset

    out = tmp_path_factory.mktemp("artifacts") / "tiny-long"
    export_artifact(build(dataclasses.replace(preset("tiny"), n_ctx=2048), seed=0), {"kind": "preset", "name": "tiny", "seed": 0}, out,
                    provider=PROVIDER)
    return out
