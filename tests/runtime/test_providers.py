"""Which provider runs a graph, and why (runtime/providers.py): a provider that cannot run here is refused in one
sentence that says why, and a file ONNX Runtime cannot load is named."""

import pytest

from kvserve.runtime import ModelUnloadable, ProviderUnavailable, cuda_available
from kvserve.runtime.providers import open_session


def test_an_unknown_provider_is_refused_by_name(tiny_artifact):
    with pytest.raises(ProviderUnavailable, match="unknown provider 'tpu'; choose one of auto, cuda, cpu"):
        open_session(tiny_artifact / "model.onnx", "float32", "tpu")


@pytest.mark.skipif(cuda_available(), reason="a CUDA host runs what is asked; the refusal is a CPU host's")
def test_cuda_asked_for_on_a_host_without_it_is_refused_and_auto_takes_the_cpu_quietly(tiny_artifact, caplog, capfd):
    with pytest.raises(ProviderUnavailable, match="CUDA requested but unavailable: "):
        open_session(tiny_artifact / "model.onnx", "float32", "cuda")
    opened = open_session(tiny_artifact / "model.onnx", "float32", "auto")
    assert opened.provider == "CPUExecutionProvider" and opened.device == "cpu" and not opened.captures_decode
    assert opened.fallback_reason is None  # no CUDA here and none asked for: nothing to warn of
    assert "libcu" not in caplog.text and "libcu" not in "".join(capfd.readouterr())


def test_a_file_onnx_runtime_cannot_load_is_named(tmp_path):
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not a graph")
    with pytest.raises(ModelUnloadable, match=f"{broken}: ONNX Runtime cannot load it"):
        open_session(broken, "float32", "cpu")
