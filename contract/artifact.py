"""The artifact directory: what `kvserve export` writes and what `kvserve serve` reads. No torch here.

    model.onnx          the graph (model.onnx.data beside it holds the weights when they are large)
    config.json         the decoder config, as transformers' config.json (model_type gpt2, llama, qwen2, mistral)
    manifest.json       architecture, K/V heads, I/O names, shapes with symbolic axes, dtypes, opset, IR version,
                        checksums, source
    golden.npz          a fixed prompt, the eager model's greedy tokens and the logits behind each one
    kv_scales.npz       an int8 K/V cache's scales, key and value, each (layers, K/V heads, head_dim) float32
    decode.onnx         a fused graph's decode-only form (float16, or weights up to CHUNKLESS_MAX_WEIGHT_BYTES)
    chunk.onnx          a fused float16 graph's form for steps with a prompt chunk beside decoding rows (no If)
    parity.json         the verify report written at export time
    tokenizer.json ...  copied from the checkpoint when it has them
"""

from __future__ import annotations

import hashlib
import json
import threading
import zipfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.errors import UserError

from .chat import load_chat_template
from .config import DecoderConfig
from .hf_config import config_from_hf
from .io_contract import ATTENTIONS, DTYPES, KV_CACHES, QUANTIZATIONS, SLOTS, STANDARD, io_spec, kv_dtype_refusal
from .tolerances import Tolerance, tolerance_for, with_own_rounding
from .tokenizer import load_tokenizer

MODEL_FILE = "model.onnx"
MODEL_DATA_FILE = "model.onnx.data"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
GOLDEN_FILE = "golden.npz"
PARITY_FILE = "parity.json"
TOKENIZER_FILE = "tokenizer.json"
KV_SCALES_FILE = "kv_scales.npz"
DECODE_GRAPH_FILE = "decode.onnx"  # a fused artifact's decode-only graph (export/decode_graph.py), its weights in MODEL_DATA_FILE or inline
CHUNK_GRAPH_FILE = "chunk.onnx"  # a fused float16 artifact's graph for steps with a chunk (export/chunk_graph.py), its weights as above
# The manifest's record of the eager model's own error in the artifact's dtype, where export's verify needed it to hold
# the graph to (tolerances.with_own_rounding): {"logits": fraction of the largest logit, "kv": relative}; absent otherwise.
OWN_ROUNDING_KEY = "own_rounding"
# Weights (bytes of the graph's files) up to which a fused artifact has a decode graph and runs its CPU steps of one row
# and no chunk through it: the step graph's If a layer is a fixed cost that only a small model's step feels (quoting
# model, 16 MiB: 0.92-0.98x; gpt2, 474 MiB: 0.99-1.01x; bench/chunkless_steps.py), and a second session packs the
# weights a second time, which only a small model affords.
CHUNKLESS_MAX_WEIGHT_BYTES = 64 << 20
# Format 2: the slots graph always outputs greedy_tokens, and the inplace layout is gone; kvserve reads format 2 alone.
FORMAT = "kvserve-artifact/2"


class ArtifactError(UserError, ValueError):
    """An artifact directory that is missing, incomplete or inconsistent; the message names the file."""


def replace_refusal(out: str | Path, overwrite: bool) -> str | None:
    """Why an export must not write to out, or None: out exists and overwrite was not asked for, or overwrite would
    delete what is not an artifact (a file, or a directory holding something else: --out ~ --overwrite, say). An empty
    directory, and an artifact of any kvserve format (a re-export), are replaced."""
    out = Path(out)
    if not out.exists():
        return None
    if not overwrite:
        return f"{out} already exists; pass --overwrite to replace it"
    if out.is_dir() and not any(out.iterdir()):
        return None
    try:
        format_name = str(json.loads((out / MANIFEST_FILE).read_text()).get("format", ""))
    except (OSError, ValueError, AttributeError):  # no manifest, not JSON, not an object: a file or someone's directory
        format_name = ""
    if not format_name.startswith(FORMAT.split("/")[0] + "/"):  # an artifact of any kvserve format, this one or older
        return (f"{out} is not a kvserve artifact (no {MANIFEST_FILE} of its format): --overwrite replaces artifacts only; "
                "move it away or choose another --out")
    return None


def check_tokenizer_files(directory: str | Path) -> None:
    """Read a checkpoint's tokenizer.json and chat template as the server reads an artifact's copies, raising a UserError
    that names the file that cannot be read: before an export spends minutes on the weights, and ships an artifact no
    server would start."""
    path = Path(directory) / TOKENIZER_FILE
    if path.exists():
        load_tokenizer(path)
    load_chat_template(directory)


def graph_bytes(directory: str | Path) -> int:
    """The bytes of an artifact's graph and weights files (MODEL_FILE and, where it has one, MODEL_DATA_FILE)."""
    return sum(path.stat().st_size for path in (Path(directory) / MODEL_FILE, Path(directory) / MODEL_DATA_FILE) if path.exists())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


_hashing: dict[Path, Future] = {}  # prefetch_checksums' digests in the making, by resolved path


def prefetch_checksums(directory: str | Path) -> None:
    """Start hashing directory's graph files on a thread of their own (hashlib lets go of the GIL), for an
    open_artifact(check_files=True) that comes later: the server starts it before its imports, which the graph's hash
    overlaps (gpt2 int8: 0.1 s of its start, bench/startup.py), and the weights' its session's opening. Files that
    are not there, or whose hashing has started already, are left alone."""
    for name in (MODEL_FILE, MODEL_DATA_FILE):
        path = (Path(directory) / name).resolve()
        if path.is_file() and path not in _hashing:
            future: Future = Future()
            _hashing[path] = future
            threading.Thread(target=lambda path=path, future=future: _hash_into(path, future), daemon=True).start()


def _hash_into(path: Path, future: Future) -> None:
    try:
        future.set_result(sha256_file(path))
    except OSError as exc:
        future.set_exception(exc)


def _checksum(path: Path) -> str:
    """path's sha256: prefetch_checksums' when it made one (used once), else computed now."""
    future = _hashing.pop(path.resolve(), None)
    return future.result() if future is not None else sha256_file(path)


@dataclass(frozen=True)
class GoldenRecord:
    """The eager reference's greedy continuation of a fixed prompt, recorded at export time."""

    prompt_ids: np.ndarray  # (T,) int64
    tokens: np.ndarray  # (N,) int64: greedy tokens
    logits: np.ndarray  # (N, V) float32: the logits each token was the argmax of

    def save(self, path: Path) -> None:
        np.savez(path, prompt_ids=self.prompt_ids, tokens=self.tokens, logits=self.logits)

    @classmethod
    def load(cls, path: Path) -> "GoldenRecord":
        try:
            with np.load(path) as data:
                record = cls(prompt_ids=data["prompt_ids"], tokens=data["tokens"], logits=data["logits"])
        except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as exc:  # numpy's errors name no file
            raise ArtifactError(f"{path}: not a golden record this kvserve reads ({type(exc).__name__}: {exc})") from None
        if not (record.prompt_ids.ndim == record.tokens.ndim == 1 and record.logits.ndim == 2 and len(record.prompt_ids)
                and len(record.logits) == len(record.tokens)):
            raise ArtifactError(f"{path}: its prompt ids {record.prompt_ids.shape}, tokens {record.tokens.shape} and logits "
                                f"{record.logits.shape} are not a golden record's (T,), (N,) and (N, V)")
        return record


def golden_prompt(vocab_size: int, length: int = 12) -> list[int]:
    """A fixed prompt that exists in every vocabulary: deterministic, spread over the ids."""
    return [(7919 * i + 13) % vocab_size for i in range(length)]


@dataclass(frozen=True)
class Artifact:
    directory: Path
    config: DecoderConfig
    manifest: dict
    unchecked: tuple[str, ...] = ()  # files whose checksums open_artifact left to check_unchecked (weights_later)

    @property
    def model_path(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def architecture(self) -> str:
        """The decoder family, "gpt2" or "llama" (DecoderConfig.architecture)."""
        return self.manifest["architecture"]

    @property
    def kv_cache(self) -> str:
        """The graph's KV cache layout, io_contract.SLOTS (what the server serves) or CONCAT (for other tools)."""
        return self.manifest["kv_cache"]

    @property
    def attention(self) -> str:
        """The graph's attention, io_contract.STANDARD or FUSED (fused: slots graphs of GPT-2 and the Llama family)."""
        return self.manifest["attention"]

    @property
    def quantization(self) -> str | None:
        """The weight quantization (io_contract.QUANTIZATIONS), None for float weights."""
        facts = self.manifest.get("quantization")
        return None if facts is None else facts["scheme"]

    @property
    def kv_dtype(self) -> str:
        """What the slots graph's K/V pool holds (io_contract.KV_DTYPES): the model's dtype unless exported otherwise."""
        return self.manifest.get("kv_dtype") or self.dtype

    @property
    def kv_ring(self) -> int | None:
        """Positions a windowed layer's ring row holds (config.DecoderConfig.kv_ring), None when the graph has no rings
        (no window, a fused or concat graph, or one exported before rings)."""
        return self.manifest.get("kv_ring")

    def ring_columns(self) -> dict[int, int]:
        """{layer: its rows' columns} of the graph's ring layers (the ring and its scratch column)."""
        ring = self.kv_ring
        return {} if ring is None else {layer: ring + 1 for layer in self.config.sliding_layers}

    @property
    def precision(self) -> str:
        """The weights' precision (the quantization, else the dtype), and the K/V's where they differ: what a report
        names its tolerance by."""
        weights = self.quantization or self.dtype
        return weights if self.kv_dtype == self.dtype else f"{weights} weights, {self.kv_dtype} K/V"

    @property
    def tolerance(self) -> Tolerance:
        """How close this artifact's numbers must stay to the eager reference's (tolerances.tolerance_for), raised to the
        floor its export measured where the dtype's own rounding needed one (OWN_ROUNDING_KEY)."""
        tolerance = tolerance_for(self.quantization or self.dtype, self.kv_dtype, self.dtype)
        floor = self.manifest.get(OWN_ROUNDING_KEY)
        return tolerance if floor is None else with_own_rounding(tolerance, floor["logits"], floor["kv"])

    def kv_scales(self) -> tuple[np.ndarray, np.ndarray] | None:
        """An int8 cache's scales of K and of V, each (L, H_kv, d_k) float32; None for a float cache."""
        if self.kv_dtype != "int8":
            return None
        with np.load(self.directory / KV_SCALES_FILE) as data:
            return data["key"], data["value"]

    @property
    def manifest_sha256(self) -> str:
        return sha256_file(self.directory / MANIFEST_FILE)

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.directory / TOKENIZER_FILE
        return path if path.exists() else None

    def check_unchecked(self) -> None:
        """Check the checksums open_artifact left for later (weights_later); raises ArtifactError naming a changed file."""
        _check_checksums(self.directory, {name: self.manifest["files"][name] for name in self.unchecked})

    def golden(self) -> GoldenRecord:
        return GoldenRecord.load(self.directory / GOLDEN_FILE)

    def parity_report(self) -> dict | None:
        path = self.directory / PARITY_FILE
        return json.loads(path.read_text()) if path.exists() else None


def _is_fraction(value) -> bool:
    """A JSON number in [0, 1) (not a boolean, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


def open_artifact(directory: str | Path, check_files: bool = True, weights_later: bool = False) -> Artifact:
    """Read and cross-check an artifact directory; with check_files, the model files' checksums too. weights_later
    leaves the weights file's (gigabytes at 3-8 B parameters: seconds of hashing) to Artifact.check_unchecked, which
    the server calls once its session, reading the same file, is open: the hash and the weights' repacking then run
    on two cores at once."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: artifact directory not found")
    for name in (MODEL_FILE, CONFIG_FILE, MANIFEST_FILE, GOLDEN_FILE):
        if not (directory / name).exists():
            raise ArtifactError(f"{directory / name}: missing (is this a kvserve export?)")
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        hf_config = json.loads((directory / CONFIG_FILE).read_text())
        if not isinstance(hf_config, dict):
            raise ValueError(f"{CONFIG_FILE} is not a JSON object")
        config = config_from_hf(hf_config)
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise ArtifactError(f"{directory}: unreadable manifest or config ({exc})") from None
    where = directory / MANIFEST_FILE
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{where}: not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{where}: format {manifest.get('format')!r}; this kvserve reads {FORMAT!r}: re-export with kvserve export")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ArtifactError(f"{where}: 'files' must map each file name to its sha256, got {type(files).__name__}")
    if MODEL_FILE not in files:
        raise ArtifactError(f"{where}: 'files' lacks {MODEL_FILE}")
    if manifest.get("dtype") not in DTYPES:
        raise ArtifactError(f"{where}: dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if manifest.get("kv_cache") not in KV_CACHES:
        raise ArtifactError(f"{where}: kv_cache {manifest.get('kv_cache')!r} is not one of {', '.join(KV_CACHES)}")
    if manifest.get("attention") not in ATTENTIONS:
        raise ArtifactError(f"{where}: attention {manifest.get('attention')!r} is not one of {', '.join(ATTENTIONS)}")
    kv_dtype = manifest.get("kv_dtype") or manifest.get("dtype")
    if kv_dtype_refusal(kv_dtype, manifest["dtype"], manifest["kv_cache"]):
        raise ArtifactError(f"{where}: kv_dtype {kv_dtype!r} cannot go with dtype {manifest['dtype']!r} and the {manifest['kv_cache']} cache")
    if kv_dtype == "int8" and KV_SCALES_FILE not in files:
        raise ArtifactError(f"{where}: an int8 K/V cache needs its scales, and 'files' lacks {KV_SCALES_FILE}")
    quantization = manifest.get("quantization")
    if quantization is not None and (not isinstance(quantization, dict) or quantization.get("scheme") not in QUANTIZATIONS):
        raise ArtifactError(f"{where}: quantization must be null or an object whose scheme is one of {', '.join(QUANTIZATIONS)}")
    ring = manifest.get("kv_ring")
    if ring is not None and (ring != config.kv_ring or manifest["kv_cache"] != SLOTS or manifest["attention"] != STANDARD):
        raise ArtifactError(f"{where}: kv_ring {ring!r} is not this model's ring ({config.kv_ring}) of a standard slots graph")
    floor = manifest.get(OWN_ROUNDING_KEY)
    if floor is not None and not (isinstance(floor, dict) and all(_is_fraction(floor.get(key)) for key in ("logits", "kv"))):
        raise ArtifactError(f"{where}: {OWN_ROUNDING_KEY} must be null or an object of 'logits' and 'kv', each a fraction in [0, 1)")
    architecture = manifest.get("architecture")
    if architecture != config.architecture or manifest.get("model_type") != config.model_type:
        raise ArtifactError(
            f"{where}: architecture {architecture!r} ({manifest.get('model_type')!r}) disagrees with config.json's "
            f"model_type {config.model_type!r}"
        )
    later = (MODEL_DATA_FILE,) if check_files and weights_later and MODEL_DATA_FILE in files else ()
    if check_files:
        _check_checksums(directory, {name: expected for name, expected in files.items() if name not in later})
        for name in later:  # a missing file is named now, whatever is left for later
            if not (directory / name).exists():
                raise ArtifactError(f"{directory / name}: missing")
    return Artifact(directory=directory, config=config, manifest=manifest, unchecked=later)


def _check_checksums(directory: Path, expected: dict[str, str]) -> None:
    for name, digest in expected.items():
        path = directory / name
        if not path.exists():
            raise ArtifactError(f"{path}: missing")
        if _checksum(path) != digest:
            raise ArtifactError(f"{path}: checksum mismatch (the file changed after export)")


def contract_problems(signature: dict[str, dict], artifact: Artifact) -> list[str]:
    """Where a live session's inputs and outputs (signature: {"inputs"|"outputs": {name: {"shape", "dtype"}}}) differ
    from the KV contract the artifact declares."""
    config = artifact.config
    expected = io_spec(config.n_layer, config.n_kv_head, config.d_head, config.vocab_size, artifact.dtype, artifact.kv_cache, artifact.attention,
                       artifact.kv_dtype, config.long_rope_after is not None, artifact.ring_columns())
    live = signature
    problems = []
    for side in ("inputs", "outputs"):
        if list(live[side]) != list(expected[side]):
            problems.append(f"graph {side} are {list(live[side])[:4]}..., expected {list(expected[side])[:4]}...")
            continue
        for name, want in expected[side].items():
            got = live[side][name]
            if got["dtype"] != want["dtype"]:
                problems.append(f"{name} has dtype {got['dtype']}, expected {want['dtype']}")
            if len(got["shape"]) != len(want["shape"]):
                problems.append(f"{name} has rank {len(got['shape'])}, expected {len(want['shape'])}")
                continue
            for axis, (g, w) in enumerate(zip(got["shape"], want["shape"])):
                if isinstance(w, str) and isinstance(g, int):
                    problems.append(f"{name} axis {axis} is fixed at {g}, expected symbolic {w!r}")
                elif isinstance(w, int) and g != w:
                    problems.append(f"{name} axis {axis} is {g}, expected {w}")
    return problems
