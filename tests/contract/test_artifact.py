"""The artifact directory (contract/artifact.py): opened and cross-checked before anything runs it, each problem named
with the file it is in, and a live session's signature compared with the contract the manifest declares."""

import json
import re
import shutil

import pytest

from kvserve.contract.artifact import ArtifactError, contract_problems, golden_prompt, open_artifact


@pytest.fixture
def copied(tiny_artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy)
    return copy


def edit_manifest(directory, **fields):
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.update(fields)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("breakage, message", [
    (lambda d: (d / "golden.npz").unlink(), "golden.npz: missing (is this a kvserve export?)"),
    (lambda d: (d / "manifest.json").write_text("{"), "unreadable manifest or config"),
    (lambda d: edit_manifest(d, format="kvserve-artifact/0"), "re-export with kvserve export"),
    (lambda d: edit_manifest(d, dtype="bfloat16"), "dtype 'bfloat16' is not one of float32, float16"),
    (lambda d: edit_manifest(d, attention="flash"), "attention 'flash' is not one of"),
    (lambda d: edit_manifest(d, model_type="llama", architecture="llama"), "disagrees with config.json's model_type 'gpt2'"),
    (lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes() + b"x"), "checksum mismatch"),
    (lambda d: edit_manifest(d, kv_dtype="int4"), "kv_dtype 'int4' cannot go with dtype 'float32' and the slots cache"),
    (lambda d: edit_manifest(d, kv_dtype="int8"), "an int8 K/V cache needs its scales, and 'files' lacks kv_scales.npz"),
    (lambda d: edit_manifest(d, own_rounding={"logits": 0.02}), "own_rounding must be null or an object of 'logits' and 'kv'"),
    (lambda d: edit_manifest(d, own_rounding={"logits": 0.02, "kv": 3}), "own_rounding must be null or an object of 'logits' and 'kv'"),
], ids=["file missing", "unreadable", "old format", "dtype", "attention", "architecture", "checksum", "kv dtype", "kv scales",
        "own rounding without kv", "own rounding not a fraction"])
def test_each_problem_is_named_with_its_file(copied, breakage, message):
    breakage(copied)
    with pytest.raises(ArtifactError, match=re.escape(message)):
        open_artifact(copied)


def test_checksums_hashed_ahead_are_the_ones_checked_and_a_changed_graph_is_still_refused(copied):
    """The server hashes the graph files while it imports (prefetch_checksums); open_artifact checks those digests."""
    from kvserve.contract import artifact

    artifact.prefetch_checksums(copied)
    assert (copied / "model.onnx").resolve() in artifact._hashing
    open_artifact(copied)
    assert not [path for path in artifact._hashing if copied.resolve() in path.parents]  # each digest is used once
    (copied / "model.onnx").write_bytes((copied / "model.onnx").read_bytes() + b"x")
    artifact.prefetch_checksums(copied)
    with pytest.raises(ArtifactError, match="model.onnx: checksum mismatch"):
        open_artifact(copied)
    artifact.prefetch_checksums(copied / "nowhere")  # nothing there: nothing started, open_artifact names it
    assert not [path for path in artifact._hashing if copied.resolve() in path.parents]


def test_the_weights_checksum_left_for_later_is_checked_by_check_unchecked_and_only_then(copied):
    """The server leaves the weights file's hash (gigabytes at 8 B) to run beside its session's opening: open_artifact
    with weights_later checks everything else, and check_unchecked the weights, against the manifest still."""
    from kvserve.contract.artifact import sha256_file

    weights = copied / "model.onnx.data"
    weights.write_bytes(bytes(range(256)) * 64)
    manifest = json.loads((copied / "manifest.json").read_text())
    edit_manifest(copied, files={**manifest["files"], "model.onnx.data": sha256_file(weights)})
    open_artifact(copied, weights_later=True).check_unchecked()
    assert open_artifact(copied).unchecked == ()  # checked at once: nothing left
    weights.write_bytes(b"\xff" + weights.read_bytes()[1:])
    later = open_artifact(copied, weights_later=True)
    assert later.unchecked == ("model.onnx.data",)
    with pytest.raises(ArtifactError, match="model.onnx.data: checksum mismatch"):
        later.check_unchecked()
    with pytest.raises(ArtifactError, match="model.onnx.data: checksum mismatch"):
        open_artifact(copied)
    weights.unlink()  # a missing weights file is named at once, whatever is left for later
    with pytest.raises(ArtifactError, match="model.onnx.data: missing"):
        open_artifact(copied, weights_later=True)


def test_an_artifact_opens_with_its_config_and_a_graph_that_is_not_its_contract_is_named(tiny_artifact):
    artifact = open_artifact(tiny_artifact)
    assert artifact.kv_cache == "slots" and artifact.attention == "fused" and artifact.dtype == "float32"
    prompt = golden_prompt(artifact.config.vocab_size)
    assert len(prompt) == 12 and all(0 <= t < artifact.config.vocab_size for t in prompt)
    signature = {side: dict(artifact.manifest[side]) for side in ("inputs", "outputs")}
    assert contract_problems(signature, artifact) == []
    logits = signature["outputs"]["logits"]
    signature["outputs"]["logits"] = {**logits, "dtype": "float16"}
    assert contract_problems(signature, artifact) == ["logits has dtype float16, expected float32"]
