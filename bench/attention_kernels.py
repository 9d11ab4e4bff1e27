"""Which kernel ONNX Runtime's CUDA GroupQueryAttention decodes with, chosen by the environment variables its kernels
read when a session is opened (onnxruntime-gpu 1.31.1; its source, contrib_ops/cuda/bert/group_query_attention.cc).
For a float16 decode step of one token it prefers XQA (TensorRT-LLM's `kernel_mha`) where the head size and group
size allow, which needs the K/V append, the sequence lengths and a scratch memset as kernels of their own beside it;
then cuDNN's SDPA on SM 9.0 and later; then FlashAttention's decode path, which appends K/V inside its own kernel
and reads the lengths as given (but not where Q/K norms are fused in). The benchmarks open a runtime under each
choice to time them side by side; nothing in kvserve sets these."""

from __future__ import annotations

import argparse
import contextlib
import os

CHOICES = {
    "default": {},
    "flash": {"ORT_ENABLE_XQA": "0", "ORT_ENABLE_CUDNN_FLASH_ATTENTION": "0"},
    "cudnn": {"ORT_ENABLE_XQA": "0", "ORT_ENABLE_CUDNN_FLASH_ATTENTION": "1"},
}


def parse(text: str) -> list[str]:
    """A comma-separated list of CHOICES' names (an argparse type: its error names the choices)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHOICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"attention kernels {text!r}: choose among {', '.join(CHOICES)}")
    return names


@contextlib.contextmanager
def opened_under(choice: str):
    """Sessions opened inside read choice's variables (GroupQueryAttention reads them as each session builds its
    kernels); the environment is as it was afterwards."""
    saved = {name: os.environ.get(name) for name in CHOICES[choice]}
    os.environ.update(CHOICES[choice])
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
