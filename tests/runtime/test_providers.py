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


def test_a_cuda_session_leaves_add_and_softmax_unfused(tiny_standard_artifact, monkeypatch):
    """ONNX Runtime's CUDA provider fuses a mask's Add and the Softmax into BiasSoftmax, whose kernel fails on an empty
    input ("cudaErrorInvalidValue", found on an H100): a decode step's prompt chunk is empty in every layer of a standard
    slots graph. Sessions on CUDA are opened without that fusion; CPU sessions keep every optimizer."""
    from kvserve.runtime import providers

    opened = []

    class Session:
        def __init__(self, path, options, providers, disabled_optimizers=()):
            opened.append((providers[0], list(disabled_optimizers)))

    monkeypatch.setattr(providers.ort, "InferenceSession", Session)
    model = tiny_standard_artifact / "model.onnx"
    options = providers.ort.SessionOptions()
    providers._open(model, options, [(providers.CUDA, {}), providers.CPU])
    providers._open(model, options, [providers.CPU])
    assert opened == [((providers.CUDA, {}), ["BiasSoftmaxFusion"]), (providers.CPU, [])]
