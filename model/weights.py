"""A model's weights as something read one tensor (or a few rows of one) at a time, and the eager models built over
them without holding them all.

A weight source answers by our parameter names (the eager modules' state_dict keys), in float32 whatever the source
holds: ModelWeights over a model in memory (a preset), checkpoint.CheckpointWeights over a checkpoint's files. Export
writes each initializer from rows of one parameter at a time; verify's eager reference (streamed_reference) holds the
token embedding, the head and the norms, and loads each block's weights as the block runs, then drops them, so a
model of 8 B parameters is checked in the memory of one float32 layer beside its tables.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Protocol

import torch
from torch import nn

from kvserve.contract.config import DecoderConfig

from .decoders import Decoder, new_decoder


class WeightSource(Protocol):
    config: DecoderConfig

    def keys(self) -> list[str]:
        """Every parameter, in the eager model's state_dict order."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of the parameter (its first axis), float32."""


def parameter(source: WeightSource, key: str) -> torch.Tensor:
    """A whole parameter, float32."""
    return source.rows(key, 0, source.shape(key)[0])


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


def weights_checksum(source: WeightSource) -> str:
    """sha256 over every parameter's name and float32 bytes, in name order: identifies the weights, not the file."""
    digest = hashlib.sha256()
    for key in sorted(source.keys()):
        digest.update(key.encode())
        digest.update(parameter(source, key).contiguous().numpy().tobytes())
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
    from .decoders import _default_init_skipped

    with _default_init_skipped(), _parameters_on_meta():
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


def streamed_reference(source: WeightSource) -> Decoder:
    """The eager float32 model of source that holds everything but its blocks (embeddings, head, final norm) and loads
    each block's parameters from source as the block runs, dropping them after: a forward pass reads every block's
    weights once, and at most one block's are in memory. Only forward (what verify, golden and calibration run) streams;
    the slots forwards are for tracing, which uses a skeleton."""
    model = skeleton(source.config)
    prefix = _block_prefix(model)
    for key in source.keys():
        if not key.startswith(prefix):
            _set(model, key, parameter(source, key))
    for index, block in enumerate(_blocks(model)):
        names = [name for name, _ in block.named_parameters()]
        meta = {name: param for name, param in block.named_parameters()}

        def load(module, args, names=names, index=index):
            for name in names:
                _set(module, name, parameter(source, f"{prefix}{index}.{name}"))

        def drop(module, args, output, meta=meta):
            for name, param in meta.items():
                _set(module, name, param.data)
            return output

        block.register_forward_pre_hook(load)
        block.register_forward_hook(drop)
    return model
