"""Checkpoints as transformers' save_pretrained writes them: a directory with config.json (and maybe
generation_config.json, whose eos_token_id wins) and the weights in model.safetensors, shards listed by
model.safetensors.index.json, or pytorch_model.bin. No network: everything is read from the directory.
Weights of any float dtype (bfloat16 included) load to float32; export casts to the artifact's dtype.

Every tensor is checked by its checkpoint name and shape, so an error names what the file holds:
- GPT-2 stores its linear layers as Conv1D, weight (in, out); ours are nn.Linear, weight (out, in), so the
  four matrices listed in TRANSPOSED are transposed on the way in and out. Everything else is a plain copy.
- Llama-family checkpoints store Q, K and V (and the MLP's gate and up) as separate matrices; ours are
  fused (llama.py), so FUSED lists which checkpoint tensors are stacked into which of ours, in order. Phi-3's
  checkpoints store them fused as ours are (STORED_FUSED), and are copied as they are.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kvserve.contract.config import GPT2_ARCH, DecoderConfig
from kvserve.contract.hf_config import GenerationConfigError, config_from_hf, config_to_hf
from kvserve.errors import UserError

from .decoders import Decoder
from .weights import ModelWeights, WeightSource, load_model, parameter, row_blocks, skeleton
from .weights import weights_checksum as source_checksum

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry (GPT-2's causal mask, old Llama's rotary frequencies); ours compute them.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# Ours <- the checkpoint's, stacked along the output axis in this order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
STORED_FUSED = ("phi3",)  # model types whose checkpoints hold qkv_proj and gate_up_proj themselves
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


# safetensors' dtype names of the float types a checkpoint's weights may be published in
SAFETENSORS_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SAFETENSORS_OTHERS = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _StoredTensor:
    """Where one checkpoint tensor lies: a safetensors file's byte range (mapped only while rows of it are read, so what
    was read leaves no trace in the process's memory), or a tensor torch.load mapped from a .bin file."""

    def __init__(self, path: Path, name: str, dtype: torch.dtype, shape: tuple[int, ...], begin: int = 0,
                 loaded: torch.Tensor | None = None):
        self.path, self.name, self.dtype, self.shape, self.begin, self.loaded = path, name, dtype, shape, begin, loaded

    @property
    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop (the first axis), float32."""
        out = torch.empty((stop - start, *self.shape[1:]), dtype=torch.float32)
        self.read_into(out, start, stop)
        return out

    def read_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Rows start..stop into out (float32, their shape), converted as they are copied. Mapped, not read into a buffer
        first: bfloat16 to float32 at 4.5 GB/s of the file against 1 GB/s through pread (a 50 MB tensor of a Qwen3-4B
        shard in the page cache, 11 ms against 51-58, timed by hand on the 2-core EPYC Zen 4 VM)."""
        if self.loaded is not None:
            out.copy_(self.loaded[start:stop])
            self._check_finite(out, start)
            return
        count = (stop - start) * math.prod(self.shape[1:])
        if count == 0:
            return
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        begin = self.begin + start * (count // (stop - start)) * itemsize
        page = begin - begin % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as file:
            if os.fstat(file.fileno()).st_size < begin + count * itemsize:
                raise CheckpointError(f"{self.path}: ends inside a tensor (it holds {os.fstat(file.fileno()).st_size} bytes)")
            mapped = mmap.mmap(file.fileno(), begin - page + count * itemsize, prot=mmap.PROT_READ, offset=page)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the mapping is read-only: it is only read
                values = torch.frombuffer(mapped, dtype=self.dtype, count=count, offset=begin - page)
            out.copy_(values.view(out.shape))
            del values
        finally:
            mapped.close()
        self._check_finite(out, start)

    def _check_finite(self, rows: torch.Tensor, start: int) -> None:
        """Refuse rows holding a NaN or an infinity (a damaged file): exported, they would fail parity with no word of why.
        A sum finds one at memory speed (1.5 ms a 64 MB block against 3.5 for the bfloat16 copy, by hand on the Intel Xeon
        AVX-512 VM); only then is the row looked for."""
        if math.isfinite(rows.sum()):
            return
        bad = (~torch.isfinite(rows)).reshape(len(rows), -1).any(1).nonzero()  # (rows at fault, 1)
        if len(bad):  # else finite values whose sum overflowed
            raise CheckpointError(f"{self.path}: tensor {self.name!r} holds NaN or infinite values (row {start + int(bad[0])}): "
                                  "the file is damaged, or was saved from a model that diverged")


# safetensors' own reader refuses a longer header; a larger length is a damaged file, not a header to allocate
SAFETENSORS_HEADER_LIMIT = 100 * 2**20


def _index_file(path: Path) -> dict[str, _StoredTensor]:
    """Every tensor of one weights file, located but not read."""
    if not path.is_file():  # a FIFO would block the read forever, a directory say nothing useful
        raise CheckpointError(f"{path}: not a regular file")
    try:
        if path.suffix == ".safetensors":
            size = path.stat().st_size
            with open(path, "rb") as file:
                (length,) = struct.unpack("<Q", file.read(8))
                if length > min(SAFETENSORS_HEADER_LIMIT, size - 8):
                    raise ValueError(f"its header length {length} is past the file's {size} bytes or safetensors' limit")
                header = json.loads(file.read(length))
            base = 8 + length
            tensors = {}
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_FLOATS.get(entry["dtype"]) or SAFETENSORS_OTHERS.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which kvserve does not read")
                begin, end = entry["data_offsets"]
                shape = tuple(entry["shape"])
                if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                    raise ValueError(f"tensor {name!r} has shape {shape}, not a list of sizes")
                if not all(isinstance(n, int) and not isinstance(n, bool) for n in (begin, end)) or not 0 <= begin <= end <= size - base:
                    raise ValueError(f"tensor {name!r}: its bytes {begin}..{end} lie outside the file's {size - base}-byte data section")
                if end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
                    raise ValueError(f"tensor {name!r}: its byte range does not fit its shape {shape}")
                tensors[name] = _StoredTensor(path, name, dtype, shape, base + begin)
            return tensors
        # torch < 1.6 wrote a format that cannot be mapped (older GPT-2 fine-tunes carry it): read whole, as transformers does
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        return {name: _StoredTensor(path, name, t.dtype, tuple(t.shape), loaded=t) for name, t in loaded.items()}
    except Exception as exc:  # the libraries' own errors name no file; ours does
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {exc})") from None


def _index_tensors(directory: Path) -> tuple[dict[str, _StoredTensor], Path]:
    """Every tensor of the checkpoint, located, and the file to name in errors (the index, for shards)."""
    index = directory / SHARD_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a shard index with a weight_map ({exc})") from None
        tensors = {}
        for shard in shards:
            # A shard is a file of this directory (a link there, as the hub's cache makes, may point anywhere)
            if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(f"{index}: lists shard {shard!r}, which is not a file name inside the checkpoint directory")
            if not (directory / shard).exists():
                raise CheckpointError(f"{index}: lists shard {shard}, which is missing")
            tensors.update(_index_file(directory / shard))
        unlisted = sorted(set(weight_map) - set(tensors))
        if unlisted:
            raise CheckpointError(f"{index}: tensor {unlisted[0]!r} is listed but in none of its shards")
        return tensors, index
    for name in WEIGHT_FILES:
        if (directory / name).exists():
            return _index_file(directory / name), directory / name
    raise CheckpointError(f"{directory}: no weights file (expected {' or '.join(WEIGHT_FILES)}, or {SHARD_INDEX} with its shards)")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def read_config(directory: Path) -> DecoderConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else None
    hf = _read_json(path)  # its refusals name the file already
    try:
        return config_from_hf(hf, generation)
    except GenerationConfigError as exc:
        raise CheckpointError(f"{generation_path}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def checkpoint_shapes(model: Decoder) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this model holds, by the checkpoint's own name, with its shape."""
    return _checkpoint_shapes({key: tuple(param.shape) for key, param in model.state_dict().items()}, model.config)


def _checkpoint_shapes(ours: dict[str, tuple[int, ...]], config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key, shape in ours.items():
        if key.endswith(TRANSPOSED):
            shapes[key] = shape[::-1]
            continue
        fused = _fused_into(key, config)
        if fused is None:
            shapes[key] = shape
            continue
        for part, size in zip(FUSED[fused], _split_sizes(config, fused)):
            shapes[key.replace(fused, part)] = (size, *shape[1:])
    return shapes


def _fused_into(key: str, config: DecoderConfig) -> str | None:
    """The FUSED module a parameter of ours belongs to, None for a plain one (and for every one of a model whose
    checkpoints store them fused)."""
    if config.model_type in STORED_FUSED:
        return None
    return next((ours for ours in FUSED if f".{ours}." in key), None)


def _split_sizes(config: DecoderConfig, fused: str) -> tuple[int, ...]:
    if fused == "self_attn.qkv_proj":
        return config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_kv_head * config.head_dim
    return config.d_mlp, config.d_mlp


def _canonical_name(name: str, config: DecoderConfig) -> str:
    # GPT-2 is published both as transformers writes it ("transformer.h.0...") and as first released ("h.0...").
    if config.architecture == GPT2_ARCH and not name.startswith("transformer.") and name != "lm_head.weight":
        return f"transformer.{name}"
    return name


def _check_sizes(config: DecoderConfig, tensors: dict[str, _StoredTensor], path: Path) -> None:
    """The config's layer count and embedding against the tensors the files hold, before a model of the config's size is laid
    out: a config.json of 10^7 layers would build 10^7 layers' modules (minutes, gigabytes) before any tensor is compared."""
    names = [_canonical_name(name, config) for name in tensors]
    prefix = "transformer.h." if config.architecture == GPT2_ARCH else "model.layers."
    layers = {int(index) for name in names if name.startswith(prefix) and (index := name[len(prefix):].split(".", 1)[0]).isdigit()}
    if config.n_layer > len(layers):
        raise CheckpointError(f"{path}: config.json says {config.n_layer} layers and the weights hold {len(layers)}")
    embedding = "transformer.wte.weight" if config.architecture == GPT2_ARCH else "model.embed_tokens.weight"
    stored = next((tensors[name] for name, key in zip(tensors, names) if key == embedding), None)
    if stored is not None and stored.shape != (config.vocab_size, config.d_model):
        raise CheckpointError(f"{path}: tensor {embedding!r} has shape {stored.shape}, and config.json says "
                              f"{(config.vocab_size, config.d_model)} (vocab_size, hidden size)")


class CheckpointWeights:
    """A checkpoint directory's weights by our parameter names (weights.WeightSource), every tensor's name, shape and
    dtype checked against the config up front, each read from its file only when asked for, as float32."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        self.directory = directory
        self.config = config = read_config(directory)
        tensors, path = _index_tensors(directory)
        _check_sizes(config, tensors, path)
        try:  # a module's constructor allocates each weight (untouched) before the skeleton moves it to the meta device
            self.shapes = {key: tuple(param.shape) for key, param in skeleton(config).state_dict().items()}
        except RuntimeError as exc:
            raise CheckpointError(f"{directory / 'config.json'}: its sizes (vocab_size {config.vocab_size}, hidden size {config.d_model}, "
                                  f"{config.n_layer} layers of MLP width {config.d_mlp}) describe a tensor larger than this machine can "
                                  f"address ({str(exc).splitlines()[0][:120]})") from None
        expected = _checkpoint_shapes(self.shapes, config)
        found: dict[str, _StoredTensor] = {}
        lm_head = None
        for name, tensor in tensors.items():
            if name.endswith(IGNORED_SUFFIXES):
                continue
            key = _canonical_name(name, config)
            if key == "lm_head.weight" and config.tie_word_embeddings:
                lm_head = tensor  # a tied head some checkpoints store anyway: it must be the embedding
                continue
            if key not in expected:
                raise CheckpointError(f"{path}: unexpected tensor {name!r} (not part of a {config.model_type} model with this config)")
            if tensor.shape != expected[key]:
                raise CheckpointError(f"{path}: tensor {key!r} has shape {tensor.shape}, expected {expected[key]}")
            if not tensor.is_floating_point:
                raise CheckpointError(f"{path}: tensor {key!r} has dtype {tensor.dtype}, expected a float type")
            found[key] = tensor
        missing = sorted(set(expected) - set(found))
        if missing:
            raise CheckpointError(f"{path}: missing tensor(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        self.found = found
        if lm_head is not None:
            self._check_tied_head(lm_head, path)

    def _check_tied_head(self, lm_head: _StoredTensor, path: Path) -> None:
        embedding = "transformer.wte.weight" if self.config.architecture == GPT2_ARCH else "model.embed_tokens.weight"
        rows, width = self.shapes[embedding]
        same = lm_head.shape == self.shapes[embedding] and all(
            torch.equal(lm_head.rows(start, stop), self.rows(embedding, start, stop)) for start, stop in row_blocks(rows, 4 * width))
        if not same:
            raise CheckpointError(
                f"{path}: lm_head.weight differs from the token embedding, but config.json says tie_word_embeddings"
                + (" (GPT-2 is always tied; untied heads are unsupported)" if self.config.architecture == GPT2_ARCH else "")
            )

    def keys(self) -> list[str]:
        return list(self.shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of our parameter key, float32: a slice of one stored tensor, of the stored tensors a fused
        one stacks (Q, K, V; gate, up), or of a transposed Conv1D's columns."""
        out = torch.empty((stop - start, *self.shapes[key][1:]), dtype=torch.float32)
        self.rows_into(key, out, start, stop)
        return out

    def rows_into(self, key: str, out: torch.Tensor, start: int, stop: int) -> None:
        fused = _fused_into(key, self.config)
        if fused is not None:
            offset = 0
            for part, size in zip(FUSED[fused], _split_sizes(self.config, fused)):
                lo, hi = max(start, offset), min(stop, offset + size)
                if lo < hi:
                    self.found[key.replace(fused, part)].read_into(out[lo - start : hi - start], lo - offset, hi - offset)
                offset += size
            return
        stored = self.found[key]
        if key.endswith(TRANSPOSED):  # (in, out) stored: our rows are its columns (GPT-2's matrices are small)
            out.copy_(stored.rows(0, stored.shape[0])[:, start:stop].T)
        else:
            stored.read_into(out, start, stop)


def load_checkpoint(directory: str | Path) -> Decoder:
    """Load a checkpoint directory into an eager float32 model, checking every tensor's name and shape against the config;
    one tensor at a time beside the model."""
    return load_model(CheckpointWeights(directory))


def checkpoint_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """source's parameters as a checkpoint names and lays them out (Q, K and V apart; GPT-2's matrices transposed), one
    parameter at a time."""
    config = source.config
    for key in source.keys():
        tensor = parameter(source, key)
        fused = _fused_into(key, config)
        if fused is not None:
            yield from zip((key.replace(fused, name) for name in FUSED[fused]), tensor.split(_split_sizes(config, fused)))
        else:
            yield key, tensor.T if key.endswith(TRANSPOSED) else tensor


def write_checkpoint(config: DecoderConfig, directory: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype = torch.float32, shard_bytes: int | None = None) -> None:
    """config.json and the tensors in the layout transformers' save_pretrained writes: model.safetensors, or with
    shard_bytes shards of about that size (model-00001-of-0000N.safetensors) and model.safetensors.index.json. One shard
    is held at a time."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    shards, shard, size, weight_map, total = [], {}, 0, {}, 0

    def flush():
        path = directory / f"shard-{len(shards):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        shards.append((path, list(shard)))

    for name, tensor in tensors:
        tensor = tensor.detach().contiguous().to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes is not None and shard and size + nbytes > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name], size, total = tensor, size + nbytes, total + nbytes
    flush()
    if shard_bytes is None:
        shards[0][0].rename(directory / "model.safetensors")
        return
    for number, (path, names) in enumerate(shards, 1):
        final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        path.rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    (directory / SHARD_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def save_checkpoint(model: Decoder, directory: str | Path, dtype: torch.dtype = torch.float32, shard_bytes: int | None = None) -> None:
    """Write config.json + model.safetensors (or shards of about shard_bytes and their index) in the layout transformers'
    from_pretrained reads."""
    write_checkpoint(model.config, directory, checkpoint_tensors(ModelWeights(model)), dtype, shard_bytes)


def weights_checksum(model: Decoder) -> str:
    """sha256 over every parameter's name and float32 bytes: identifies the weights, not the file."""
    return source_checksum(ModelWeights(model))
