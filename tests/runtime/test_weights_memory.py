"""runtime/weights_memory.py: a mapped file's pages that were read are handed back (resident memory drops), and reading
them again still gives the file's bytes; an opened session's weights file is advised so (providers.open_session)."""

import mmap
import sys

import numpy as np
import pytest

from kvserve.runtime.weights_memory import release_file_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_PAGEOUT and /proc are Linux's")


def resident_file_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


def test_read_pages_of_a_mapped_file_go_back_and_read_the_same_again(tmp_path):
    path = tmp_path / "model.onnx.data"
    content = np.random.default_rng(0).integers(0, 256, 64 * 2**20, dtype=np.uint8)  # 64 MiB
    content.tofile(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = np.frombuffer(mapped, np.uint8)
    before = resident_file_bytes()
    assert int(view[:: mmap.PAGESIZE].sum()) >= 0  # every page read: resident
    read = resident_file_bytes()
    assert read - before > 48 * 2**20
    assert release_file_pages(path) >= 64 * 2**20
    assert read - resident_file_bytes() > 48 * 2**20  # handed back
    assert np.array_equal(view, content)  # and read again from the file
    del view
    mapped.close()


def test_a_file_not_mapped_or_not_there_is_left_alone(tmp_path):
    assert release_file_pages(tmp_path / "nowhere") == 0
    (tmp_path / "unmapped").write_bytes(b"x" * 4096)
    assert release_file_pages(tmp_path / "unmapped") == 0


def test_opening_a_session_advises_its_weights_file(tiny_artifact, monkeypatch):
    from kvserve.contract.artifact import open_artifact
    from kvserve.runtime import DecoderRuntime, providers

    advised = []
    monkeypatch.setattr(providers, "release_file_pages", advised.append)
    artifact = open_artifact(tiny_artifact)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, "cpu")
    assert runtime.chunkless_session is not None  # a small artifact: its decode graph's session reads the same weights
    assert advised == [tiny_artifact / "model.onnx.data"] * 2
