"""One slots step (runtime/step.py) on standard and fused graphs: the pool bound by address and written in place, only
what sampling reads brought to the host, a binding reused while the step's shape holds; and a concat graph run as
tools run it (run_feeds)."""

import numpy as np
import pytest

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import open_artifact
from kvserve.runtime import DecoderRuntime, pool_capacity

from ..conftest import PROVIDER


def opened(artifact_dir) -> tuple[DecoderRuntime, object]:
    artifact = open_artifact(artifact_dir)
    return DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, PROVIDER), artifact.config


def prefill(runtime, pool, rows: int, row: int, prompt: list[int], with_logits: bool = True):
    """Row `row`'s whole prompt as one chunk, every other row a scratch token; sampled at the prompt's last token."""
    scratch = pool.capacity - 1
    return runtime.run_slots(pool, np.zeros(rows, np.int64), np.full(rows, scratch, np.int64), np.ones((rows, 1), np.int64),
                             np.array(prompt, np.int64), 0, row, np.array([rows + len(prompt) - 1]), with_logits)


@pytest.mark.parametrize("graph", ["tiny_standard_artifact", "tiny_fused_artifact"], ids=["standard", "fused"])
def test_a_step_writes_its_rows_k_v_in_place_and_returns_the_graphs_greedy_tokens(graph, request):
    runtime, config = opened(request.getfixturevalue(graph))
    pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    assert runtime.attention == (io.STANDARD if graph == "tiny_standard_artifact" else io.FUSED)
    sampled = prefill(runtime, pool, 2, 1, [5, 6, 7])
    assert sampled.logits.shape == (1, config.vocab_size) and sampled.greedy_tokens.tolist() == [int(sampled.logits.argmax())]
    assert runtime.traffic.logits_bytes == sampled.logits.nbytes and runtime.traffic.host_bytes == 0
    kv = pool.row_to_host(1, 3)  # written where the row lives: nothing was copied back by the step
    assert all(np.abs(array).max() > 0 for array in kv) and not np.abs(pool.row_to_host(0, 3)[0]).max()
    again = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    tokens_only = prefill(runtime, again, 2, 1, [5, 6, 7], with_logits=False)
    assert tokens_only.logits is None and tokens_only.greedy_tokens.tolist() == sampled.greedy_tokens.tolist()
    assert runtime.traffic.logits_bytes == sampled.logits.nbytes  # greedy tokens alone: no logits read back


def test_a_binding_is_reused_while_the_step_keeps_its_shape_and_made_anew_when_it_changes(tiny_standard_artifact):
    runtime, config = opened(tiny_standard_artifact)
    pool = runtime.new_pool(3, config.n_kv_head, config.d_head, pool_capacity(config))
    prefill(runtime, pool, 3, 0, [1, 2])
    first = runtime._pool_binding
    prefill(runtime, pool, 3, 1, [3, 4])
    assert runtime._pool_binding is first  # same rows bound: the same binding, its input buffers rewritten
    prefill(runtime, pool, 2, 0, [1, 2])
    assert runtime._pool_binding is not first  # two rows now: bound anew
    runtime.release_pool(pool)
    assert runtime._pool_binding is None


def test_fixed_shape_decode_steps_drive_a_standard_graph_or_a_decode_graph_only(tiny_fused_artifact):
    runtime, config = opened(tiny_fused_artifact)  # a fused step graph without its decode graph (float32: none written)
    pool = runtime.new_pool(2, config.n_kv_head, config.d_head, pool_capacity(config))
    with pytest.raises(ValueError, match="a fused step graph's decode steps go through run_slots"):
        runtime.run_decode(pool, np.zeros(2, np.int64), np.zeros(2, np.int64), np.ones((2, 64), np.int64))


def test_a_concat_graph_runs_from_host_feeds_and_returns_logits_and_every_present(tiny_concat_artifact):
    runtime, config = opened(tiny_concat_artifact)
    ids = np.array([[5, 6, 7]], np.int64)  # (B, T)
    empty = np.zeros((1, config.n_kv_head, 0, config.d_head), np.float32)  # (B, H_kv, 0, d_k)
    feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids), io.POSITION_IDS: np.arange(3)[None],
             **{name: empty for layer in range(config.n_layer) for name in io.past_names(layer)}}
    logits, *present = runtime.run_feeds(feeds)
    assert logits.shape == (1, 3, config.vocab_size) and len(present) == 2 * config.n_layer
    assert present[0].shape == (1, config.n_kv_head, 3, config.d_head)
    assert set(runtime.signature()["outputs"]) == {io.LOGITS, *(n for layer in range(config.n_layer) for n in io.present_names(layer))}


def test_a_kept_binding_copies_each_steps_inputs_to_the_device_that_reads_them(monkeypatch):
    """ONNX Runtime copies a host buffer bound to a CUDA session's input when it is bound, not when the step runs: a
    binding kept across steps (BoundStep) whose host buffers alone were rewritten ran every chunk after the first of the
    same length on the first one's tokens (found on an H100: parity failed from the second chunk). Bound on a device,
    each step's values are copied there; a new shape is bound anew."""
    from kvserve.runtime.step import BoundStep, ort

    class DeviceValue:  # an input's memory on the device: what the step reads
        def __init__(self, array):
            self.array = np.array(array, copy=True)

        def update_inplace(self, array):
            self.array = np.array(array, copy=True)

    class Binding:
        def __init__(self):
            self.inputs = {}

        def bind_ortvalue_input(self, name, value):
            self.inputs[name] = value

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(lambda array, device="cpu", device_id=0: DeviceValue(array)))
    binding = Binding()
    bound = BoundStep(binding, "cuda")
    bound.set_input(io.CHUNK_IDS, np.array([[1, 2, 3]]))
    bound.set_input(io.CHUNK_IDS, np.array([[4, 5, 6]]))  # the same shape: the buffer bound last step
    assert binding.inputs[io.CHUNK_IDS].array.tolist() == [[4, 5, 6]]
    bound.set_input(io.CHUNK_IDS, np.array([[7, 8]]))
    assert binding.inputs[io.CHUNK_IDS].array.tolist() == [[7, 8]]
