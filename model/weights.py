"""A model's weights as something read one tensor (or a few rows of one) at a time, and the eager models built over
them without holding them all.

A weight source answers by our parameter names (the eager modules' state_dict keys), in float32 whatever the source
holds: ModelWeights over a model in memory (a preset), checkpoint.CheckpointWeights over a checkpoint's files. Export
writes each initializer from rows of one parameter at a time; verify's eager reference (streamed_reference) holds the
norms and biases, reads each linear layer's weights into one float32 buffer as it runs, the embedding's looked-up rows
and the head a block of rows at a time, so a model of 8 B parameters is checked in the memory of its largest matrix.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.contract.config import DecoderConfig

from .decoders import Decoder, default_init_skipped, new_decoder


class WeightSource(Protocol):
    config: DecoderConfig

    def keys(self) -> list[str]:
        """Every parameter, in the eager model's state_dict order."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of the parameter (its first axis), float32."""

    def rows_into(self, key: str, out: torch.Tensor, start: int, stop: int) -> None:
        """rows(key, start, stop) written into out (float32, of their shape)."""


def parameter(source: WeightSource, key: str) -> torch.Tensor:
    """A whole parameter, float32."""
    return source.rows(key, 0, source.shape(key)[0])


# A large weight is read, hashed, quantized or multiplied this many float32 bytes of rows at a time (a 1.5 GB table in
# 24 blocks): what one weight costs in memory while it streams.
BLOCK_BYTES = 64 * 2**20


def row_blocks(rows: int, row_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive blocks of rows, each about BLOCK_BYTES."""
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class ModelWeights:
    """The weights of an eager model in memory (a preset's, or one already loaded)."""

    def __init__(self, model: Decoder):
        self.model, self.config = model, model.config
        self.state = model.state_dict()

    def keys(self) -> list[str]:
        return list(self.state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.state[key][start:stop].float()

    def rows_into(self, key: str, out: torch.Tensor, start: int, stop: int) -> None:
        out.copy_(self.state[key][start:stop])


def weights_checksum(source: WeightSource) -> str:
    """sha256 over every parameter's name and float32 bytes, in name order: identifies the weights, not the file. Read a
    block of rows at a time."""
    digest = hashlib.sha256()
    for key in sorted(source.keys()):
        digest.update(key.encode())
        shape = source.shape(key)
        for start, stop in row_blocks(shape[0], 4 * math.prod(shape[1:])):
            digest.update(source.rows(key, start, stop).contiguous().numpy().data)
    return digest.hexdigest()


@contextlib.contextmanager
def _parameters_on_meta():
    """Within this block every module's parameters are made on the meta device: shapes without memory. Buffers and
    whatever a constructor computes (rotary frequencies) stay real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(config: DecoderConfig, dtype: torch.dtype = torch.float32) -> Decoder:
    """A decoder of config whose parameters have shapes and dtype but no memory (the meta device), in eval mode."""
    with default_init_skipped(), _parameters_on_meta():
        model = new_decoder(config)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=False)
    return model.eval()


def _blocks(model: Decoder) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _block_prefix(model: Decoder) -> str:
    return "transformer.h." if hasattr(model, "transformer") else "model.layers."


def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


# A reference whose float32 weights are at most this many bytes is loaded whole (its forwards read nothing again); a
# larger one streams its blocks (streamed_reference): GPT-2 small (0.50 GB) whole, Qwen2.5-0.5B (1.97 GB) and up streamed.
IN_MEMORY_REFERENCE_BYTES = 2**29


def float32_bytes(source: WeightSource) -> int:
    return 4 * sum(math.prod(source.shape(key)) for key in source.keys())


def load_model(source: WeightSource) -> Decoder:
    """The eager float32 model of source, every weight in memory (filled one parameter at a time)."""
    with default_init_skipped():
        model = new_decoder(source.config)
    with torch.no_grad():
        for key, param in model.state_dict().items():
            param.copy_(parameter(source, key))
    return model.eval()


def reference_model(source: WeightSource) -> Decoder:
    """The eager float32 model verify holds an artifact of source to: whole when small, streamed block by block when not
    (IN_MEMORY_REFERENCE_BYTES); either way weight_source_of(it) is source."""
    if float32_bytes(source) <= IN_MEMORY_REFERENCE_BYTES:
        model = load_model(source)
        model.weight_source = source
        return model
    return streamed_reference(source)


def weight_source_of(model: Decoder) -> WeightSource:
    """Where model's weights come from: the source it was built over, else the model itself."""
    return getattr(model, "weight_source", None) or ModelWeights(model)


class _StreamedEmbedding(nn.Module):
    """A token embedding that reads the rows a forward looks up from the source, and nothing else. Its weight is an
    empty float32 tensor: what empty_cache asks of it is its dtype and device."""

    def __init__(self, source: WeightSource, key: str):
        super().__init__()
        self.source, self.key = source, key
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, inverse = input_ids.unique(return_inverse=True)
        rows = torch.empty((len(ids), self.source.shape(self.key)[1]))  # (U, C)
        for row, token in enumerate(ids.tolist()):
            self.source.rows_into(self.key, rows[row : row + 1], token, token + 1)
        return rows[inverse]  # (..., C)


class _StreamedHead:
    """x (..., C) by the (V, C) head key of source, a block of its rows at a time into one buffer kept between calls:
    (..., V)."""

    def __init__(self, source: WeightSource, key: str):
        self.source, self.key = source, key
        vocab, width = source.shape(key)
        self.blocks = list(row_blocks(vocab, 4 * width))
        self.buffer = torch.empty((self.blocks[0][1], width))  # (rows, C)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((*x.shape[:-1], self.source.shape(self.key)[0]))  # (..., V)
        for start, stop in self.blocks:
            weight = self.buffer[: stop - start]
            self.source.rows_into(self.key, weight, start, stop)
            out[..., start:stop] = F.linear(x, weight)
        return out



def streamed_reference(source: WeightSource) -> Decoder:
    """The eager float32 model of source that holds none of its matrices: each block's linear layers read their weights
    from source as they run, into one buffer the size of the largest, and drop them after; the token embedding reads the
    rows it looks up, and a Llama-family head (tied or not) is multiplied a block of rows at a time. Only the norms and
    biases (and GPT-2's tied table and position table, whose head is inline in its forward) stay. A forward pass reads
    every weight once. Only forward (what verify, golden and calibration run) streams; the slots forwards are for
    tracing, which uses a skeleton."""
    model = skeleton(source.config)
    prefix = _block_prefix(model)
    streamed_tables = set()
    if not hasattr(model, "transformer"):
        model.model.embed_tokens = _StreamedEmbedding(source, "model.embed_tokens.weight")
        head = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        model.head = _StreamedHead(source, head)
        streamed_tables = {"model.embed_tokens.weight", "lm_head.weight"}
    streamed = {f"{prefix}{index}.{name}.weight": module for index, block in enumerate(_blocks(model))
                for name, module in block.named_modules() if isinstance(module, nn.Linear)}
    for key in source.keys():
        if key not in streamed and key not in streamed_tables:
            _set(model, key, parameter(source, key))
    # One float32 buffer for whichever matrix runs: reused, not allocated a matrix at a time (fresh pages cost the kernel
    # a fault and a zeroing each, most of a streamed forward's time when it did).
    scratch = torch.empty(max(module.weight.numel() for module in streamed.values()))

    def load(module, args, key):
        shape = tuple(module.weight.shape)
        weight = scratch[: math.prod(shape)].view(shape)
        source.rows_into(key, weight, 0, shape[0])
        module._parameters["weight"] = nn.Parameter(weight, requires_grad=False)

    def drop(module, args, output, meta):
        module._parameters["weight"] = meta
        return output

    for key, module in streamed.items():
        module.register_forward_pre_hook(partial(load, key=key))
        module.register_forward_hook(partial(drop, meta=module.weight))
    model.weight_source = source
    return model
