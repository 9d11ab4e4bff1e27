"""One slots step (contract/io_contract.py) over a SlotPool, for standard and fused graphs: what the server's
batch (service/core/batch.py) and export's parity driver (export/parity_drivers.py) run.

A step binds the pool's rows 0..B-1 by address as both past and present, so ONNX Runtime writes each new token's
K/V into its row and the cache never passes through the host. Only what sampling reads comes back to host memory:
each sampled row's greedy token, computed in the graph (io_contract.GREEDY_TOKENS), and its logits only when a row
needs them (it samples, penalises repetition, reports log-probabilities, or is the gate's): a step of greedy rows
reads K tokens instead of K x V floats.

A fused graph (GroupQueryAttention: GPT-2 and the Llama family) binds the rows and the chunk's row separately, each as its own
past and present; run_slots keeps its meaning for both graphs and arranges a fused step itself (_run_fused). On
CUDA the fused kernel is float16 only: a float32 fused graph is refused there with the fix named.

A fused artifact with a chunk graph (export/chunk_graph.py) may serve every step without the step graph's If a layer:
steps with a prompt chunk beside decoding rows through the chunk graph, all others through the decode graph (what
DecoderRuntime does on CUDA: splits_steps).

A fused graph also prefills several fresh prompts (no past) at once, each whole, as rows of one call
(run_prompts): the operator runs B rows of S tokens from column 0, and only a prompt's first step may have more than
one row of several tokens (it refuses that once a row has a past). Shorter prompts are padded on the right with
tokens the operator takes for real ones: a real token never reads them (they come after it), and the row's next
token overwrites the first of their columns before any step reads it. The batch pads a prompt chunk so too
(prompt_length, pads_prompts: on CUDA, where each new length's first run stalls a step).

Decode-only steps at fixed shapes (CUDA graphs) are cuda_graphs.py's; the session and its provider providers.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import CHUNK_GRAPH_FILE, CHUNKLESS_MAX_WEIGHT_BYTES, DECODE_GRAPH_FILE, graph_bytes

from .cuda_graphs import GRAPH_ID, FixedDecodeSteps
from .pool import KvTraffic, SlotPool, settle_uploads
from .providers import ModelUnloadable, ProviderUnavailable, open_session, planned_device, run_bound
from .sampled import Sampled

# A prompt group's rows (and a prompt chunk) run at least this many tokens each where pads_prompts: with lengths rounded
# up to powers of two, a budget of 32 gives a CUDA server one group shape (2 x 16) to warm up rather than one a length.
MIN_PROMPT_BUCKET = 16

# Bindings kept per runtime: a batch's steps alternate between a few row layouts (all rows, the rows up to a joining
# prompt's, one row checking drafts alone), each bound once rather than at every change.
BINDINGS_KEPT = 4
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int8)": "int8", "tensor(int64)": "int64"}


class DecoderRuntime:
    """One ONNX Runtime session over an exported decoder graph, and the slots step over it."""

    def __init__(self, model_path: str | Path, n_layer: int, dtype: str, provider: str = "auto", threads: int = 0,
                 cuda_graph: bool = False, decode_graph: bool | None = None, chunkless_steps: bool | None = None,
                 chunk_graph: bool | None = None):
        """cuda_graph: capture decode steps of fixed shapes as CUDA graphs where ONNX Runtime can (run_decode).
        decode_graph: a fused graph's fixed-shape decode steps run its artifact's decode graph (DECODE_GRAPH_FILE beside
        model_path, a session of its own); None: when they can be captured (cuda_graph on the CUDA provider).
        chunkless_steps: run_slots' fused steps of one row and no chunk beside it (a row decoding or checking drafts
        alone, a prompt chunk alone) run the decode graph too (on the CPU provider, where the artifact has one); None:
        where its weights are small (artifact.CHUNKLESS_MAX_WEIGHT_BYTES). Steps of more rows keep the step graph: with a
        thread pool a session, there the If a layer weighed less (16 rows: 0.96-1.02x through the decode graph) and each
        change of session cost more (16 rows with a prompt chunk every other step: 1.12x slower); on the process's one
        pool (providers.session_options) bench/chunkless_steps.py measured 16 rows 0.95x and 0.96x with a chunk every
        fourth step, which serving does not use yet.
        chunk_graph: the steps split between two graphs without an If, the step graph not opened: a step with a prompt
        chunk beside decoding rows runs the artifact's chunk graph (CHUNK_GRAPH_FILE), every other step its decode graph
        (splits_steps); None: on the CUDA provider, where the artifact has both (the If a layer costs a CUDA step ~0.2 ms
        a layer, and its first run at each new shape ~50 ms)."""
        model_path = Path(model_path)
        decode_path, chunk_path = model_path.parent / DECODE_GRAPH_FILE, model_path.parent / CHUNK_GRAPH_FILE
        device = planned_device(provider)
        self.splits_steps = decode_path.exists() and chunk_path.exists() and (chunk_graph or (chunk_graph is None and device == "cuda"))
        if chunk_graph and not self.splits_steps:
            missing = " and ".join(p.name for p in (chunk_path, decode_path) if not p.exists())
            raise ModelUnloadable(f"{model_path.parent}: splitting steps between a chunk graph and a decode graph needs both, and it has no "
                                  f"{missing} (a fused float16 export writes them)")
        fused_decode = decode_path.exists() and (self.splits_steps or decode_graph or (decode_graph is None and cuda_graph and device == "cuda"))
        chunkless = decode_path.exists() and device == "cpu" and (
            chunkless_steps or (chunkless_steps is None and graph_bytes(model_path.parent) <= CHUNKLESS_MAX_WEIGHT_BYTES))
        # A fused step graph holds an If, which no CUDA graph captures: its decode steps are the decode graph's to capture.
        opened = open_session(chunk_path if self.splits_steps else model_path, dtype, provider, threads, cuda_graph and not fused_decode)
        self.session, self.provider, self.device = opened.session, opened.provider, opened.device
        self.fallback_reason = opened.fallback_reason
        self.n_layer = n_layer
        inputs = {i.name: i for i in self.session.get_inputs()}
        if (held := next((layer for layer in range(n_layer) if io.past_names(layer)[0] not in inputs), n_layer)) < n_layer:
            raise ModelUnloadable(f"{model_path}: its graph takes the K/V of {held} layers where config.json says {n_layer}: the "
                                  "graph and config of different exports")
        self.kv_dtype = NUMPY_DTYPES[ORT_TYPES[inputs[io.past_names(0)[0]].type]]  # what the pool holds: the graph says (KV_DTYPES)
        # a ring layer's rows are fixed in width (io_contract): {layer: columns}, as the graph says
        self.rings = {layer: inputs[io.past_names(layer)[0]].shape[2] for layer in range(n_layer)
                      if isinstance(inputs[io.past_names(layer)[0]].shape[2], int)}
        scratch = self.session.get_modelmeta().custom_metadata_map.get(io.SCRATCH_POSITION)
        if self.rings and scratch is None:
            raise ValueError(f"{model_path}: a graph with ring rows names no scratch position ({io.SCRATCH_POSITION}): re-export it")
        self.scratch_position = None if scratch is None else int(scratch)  # a ring graph's scratch tokens run there
        self.attention = io.FUSED if io.chunk_past_names(0)[0] in inputs else io.STANDARD  # the graph says which it is
        self.long_rope = io.LONG_ROPE in inputs  # a longrope model's graph: each step says which rows turn long
        if self.attention == io.FUSED and self.device == "cuda" and dtype == "float32":
            raise ProviderUnavailable("ONNX Runtime runs GroupQueryAttention on CUDA in float16 only: export this model with "
                                      "--dtype float16, or --attention standard, to serve it on the GPU")
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.vocab_size = outputs[io.LOGITS].shape[-1]
        self._chunk_past_names = [n for i in range(n_layer) for n in io.chunk_past_names(i)]
        self._chunk_present_names = [n for i in range(n_layer) for n in io.chunk_present_names(i)]
        self._past_names = [n for i in range(n_layer) for n in io.past_names(i)]
        self._present_names = [n for i in range(n_layer) for n in io.present_names(i)]
        self.traffic = KvTraffic()
        self._bindings: dict[tuple, BoundStep] = {}  # (pool, rows, first_row) -> its binding, the latest used last
        self._unread_logits: np.ndarray | None = None  # (K, V) float32: where the CPU's steps write logits nobody reads
        self._unread_views: dict[int, ort.OrtValue] = {}  # rows -> an OrtValue over _unread_logits' first rows
        self._uncaptured = ort.RunOptions()
        self._uncaptured.add_run_config_entry(GRAPH_ID, "-1")  # other steps' shapes vary: never captured
        self._uncaptured.log_severity_level = 4  # a failed run is raised with ONNX Runtime's message (run_bound), not logged twice
        captures, note, decode_session = opened.captures_decode, opened.cuda_graph_note, None
        if self.attention == io.FUSED:
            if fused_decode:
                decoder = open_session(decode_path, dtype, opened.device, threads, cuda_graph)
                decode_session, captures, note = decoder.session, decoder.captures_decode, decoder.cuda_graph_note
            elif cuda_graph:
                captures, note = False, "CUDA graphs off: this fused artifact has no decode graph (re-export it); decode steps run uncaptured"
        self.decodes_fixed = self.attention == io.STANDARD or decode_session is not None  # whether run_decode can run
        self.chunkless_session = None  # where run_slots' fused steps of one row and no chunk run (splits_steps: of any rows), when not self.session
        if self.splits_steps:  # every step without a chunk beside decoding rows
            self.chunkless_session = decode_session
        elif chunkless and self.attention == io.FUSED and self.device == "cpu":
            self.chunkless_session = decode_session or open_session(decode_path, dtype, "cpu", threads).session
        # a decode graph exported before its total was bounded by its tables refuses a pool wider than its context
        self.pads_pool = all(io.DECODE_TOTAL_WITHIN_TABLES in session.get_modelmeta().custom_metadata_map
                             for session in (decode_session, self.chunkless_session) if session is not None)
        # A prompt group's rows, and a fused graph's prompt chunks, run at a length rounded up to a power of two
        # (prompt_length): on CUDA each new shape's first run costs the step ~50-100 ms (bench/results/h200.md), so the
        # shapes a server runs stay few and are warmed up; on the CPU padding is compute spent for nothing.
        self.pads_prompts = self.device == "cuda"
        self.fixed_steps = FixedDecodeSteps(decode_session or self.session, self.attention, self.device, self.kv_dtype, self.vocab_size,
                                            (self._past_names, self._present_names), self.traffic, captures, note, self._uncaptured)

    @property
    def captures_decode(self) -> bool:
        """Whether fixed-shape decode steps are captured as CUDA graphs (until a capture fails)."""
        return self.fixed_steps.captures

    @property
    def cuda_graph_note(self) -> str | None:
        """Why CUDA graphs were asked for and are off (or stopped), else None."""
        return self.fixed_steps.cuda_graph_note

    def signature(self) -> dict[str, dict]:
        """{"inputs"|"outputs": {name: {"shape": [...], "dtype": ...}}} as the live session reports it."""

        def describe(args):
            return {a.name: {"shape": list(a.shape), "dtype": ORT_TYPES.get(a.type, a.type)} for a in args}

        return {"inputs": describe(self.session.get_inputs()), "outputs": describe(self.session.get_outputs())}

    def new_pool(self, rows: int, n_kv_head: int, d_head: int, capacity: int) -> SlotPool:
        """A pool on this session's device whose copies count in this runtime's traffic (a ring graph's rings as wide as the
        graph says, its scratch tokens where it says; rows padded to whole pages where its graphs allow, pads_pool)."""
        return SlotPool(rows, n_kv_head, d_head, capacity, self.n_layer, self.kv_dtype, self.device, self.traffic, self.rings,
                        self.scratch_position, remap_rows=self.pads_pool)

    def run_decode(self, pool: SlotPool, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray | None,
                   with_logits: bool = True, before_run: Callable[[], None] | None = None, long_rope: np.ndarray | None = None) -> Sampled:
        """A decode-only step at a fixed shape (cuda_graphs.FixedDecodeSteps.run): a standard slots graph, or a fused one's
        decode graph (decodes_fixed; its steps read no mask: None)."""
        return self.fixed_steps.run(pool, input_ids, position_ids, attention_mask, with_logits, before_run, long_rope)

    def fixed_shapes(self, pool: SlotPool) -> list[tuple[int, int]]:
        """The (rows, width) shapes run_decode has bound for pool, in the order they were first run."""
        return self.fixed_steps.shapes(pool)

    def release_pool(self, pool: SlotPool) -> None:
        """Forget every binding of pool (and release its CUDA graphs): the pool is no longer used."""
        self.fixed_steps.release(pool)
        self._bindings = {key: bound for key, bound in self._bindings.items() if key[0] is not pool}

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Every output of one plain run over host feeds, in the graph's order: how tools that drive a concat graph
        themselves (export's parity driver) run it, each step's present fed back as past."""
        return self.session.run(None, feeds)

    @contextlib.contextmanager
    def step_graph_only(self) -> Iterator[None]:
        """Every run_slots step through the step graph while inside: the parity checks and the load gate hold the step
        graph to the reference (a small artifact's steps of one row otherwise run its decode graph, and would hide a
        step graph that steps of several rows serve), then the decode graph's one-row steps apart. A runtime that splits
        its steps (chunk_graph) has no step graph open: it refuses."""
        if self.splits_steps:
            raise ValueError("this runtime splits its steps between the chunk graph and the decode graph: it has no step graph open")
        kept, self.chunkless_session = self.chunkless_session, None
        try:
            yield
        finally:
            self.chunkless_session = kept

    def _bound_pool(self, pool: SlotPool, rows: int, first_row: int = 0, chunk_row: int | None = None,
                    chunkless: bool = False) -> BoundStep:
        """An IO binding with the pool's rows first_row .. first_row + rows - 1 bound as past and present (and, for a fused
        graph, row chunk_row as the chunk's past and present; chunkless: of the chunkless session, which has no chunk).
        Bindings are kept by the rows they bind (BINDINGS_KEPT, the least recently used dropped) and reused while the
        next step binds the same rows: decode steps in a row do, and the steps of a batch alternate between a few
        layouts (plain, a prompt chunk, a row checking drafts); a kept binding whose chunk row differs rebinds the
        chunk's K/V alone."""
        key = (pool, rows, first_row, chunkless)
        bound = self._bindings.pop(key, None)
        if bound is None:
            bound = BoundStep(self.chunkless_session if chunkless else self.session, self.device)
            self._bind_rows(bound, pool, self._past_names, self._present_names, first_row, rows)
            if len(self._bindings) >= BINDINGS_KEPT:
                del self._bindings[next(iter(self._bindings))]
        self._bindings[key] = bound  # the latest used last
        if chunk_row is not None and bound.chunk_row != chunk_row:
            self._bind_rows(bound, pool, self._chunk_past_names, self._chunk_present_names, chunk_row, 1)
            bound.chunk_row = chunk_row
        return bound

    def _bind_rows(self, bound: BoundStep, pool: SlotPool, past_names: list[str], present_names: list[str], row: int,
                   count: int) -> None:
        for index, (past_name, present_name, value) in enumerate(zip(past_names, present_names, pool.values)):
            shape = pool.value_shape(index, count)  # (B, H, C, d_k): consecutive rows from row on
            address = value.data_ptr() + row * pool.value_row_bytes(index)
            bound.binding.bind_input(past_name, self.device, 0, self.kv_dtype, shape, address)
            bound.binding.bind_output(present_name, self.device, 0, self.kv_dtype, shape, address)

    def run_slots(
        self,
        pool: SlotPool,
        input_ids: np.ndarray,  # (B,) a token per row 0..B-1
        position_ids: np.ndarray,  # (B,) its position = write column
        attention_mask: np.ndarray | None,  # (B, W) the columns each row reads (a fused graph reads none: may be None)
        chunk_ids: np.ndarray,  # (T,) a prompt chunk of row chunk_slot (may be empty)
        chunk_start: int,  # the chunk's first position
        chunk_slot: int,
        logits_index: np.ndarray,  # (K,) which of the B + T tokens get logits
        with_logits: bool = True,  # False: greedy tokens alone will do
        before_run: Callable[[], None] | None = None,  # called with every input bound, just before the model runs
        long_rope: np.ndarray | None = None,  # (B,) a longrope graph's rows that turn long (None: none)
        chunk_long_rope: bool = False,  # and whether the chunk does
    ) -> Sampled:
        """One slots step; returns its K sampled rows' greedy tokens and logits in host memory. The pool's rows 0..B-1
        are updated in place."""
        if self.attention == io.FUSED:
            return self._run_fused(pool, input_ids, position_ids, chunk_ids, chunk_start, chunk_slot, logits_index, with_logits,
                                   before_run, long_rope, chunk_long_rope)
        rows = input_ids.shape[0]
        bound = self._bound_pool(pool, rows)
        if self.long_rope:
            bound.set_input(io.LONG_ROPE, np.zeros(rows, np.int64) if long_rope is None else np.asarray(long_rope))  # (B,)
            bound.set_input(io.CHUNK_LONG_ROPE, np.array([int(chunk_long_rope)]))  # (1,)
        chunk = np.asarray(chunk_ids).reshape(1, -1)  # (1, T)
        bound.set_input(io.INPUT_IDS, np.asarray(input_ids).reshape(rows, 1))  # (B, 1)
        bound.set_input(io.POSITION_IDS, np.asarray(position_ids).reshape(rows, 1))  # (B, 1)
        bound.set_input(io.ATTENTION_MASK, attention_mask)
        bound.set_input(io.CHUNK_IDS, chunk)
        chunk_end = chunk_start + chunk.shape[1]
        bound.set_input(io.CHUNK_POSITION_IDS, np.arange(chunk_start, chunk_end)[None])  # (1, T)
        bound.set_input(io.CHUNK_ATTENTION_MASK, np.ones((1, max(chunk_end, 1))))  # (1, W): its row's columns so far
        bound.set_input(io.CHUNK_SLOT, np.array([chunk_slot]))
        bound.set_input(io.LOGITS_INDEX, logits_index)
        return self._run_sampled(bound, len(logits_index), with_logits, before_run)

    def _run_fused(self, pool: SlotPool, input_ids, position_ids, chunk_ids, chunk_start: int, chunk_slot: int, logits_index,
                   with_logits: bool, before_run: Callable[[], None] | None, long_rope: np.ndarray | None = None,
                   chunk_long_rope: bool = False) -> Sampled:
        """run_slots for a fused graph, whose operator needs a row and a token at least (io_contract): the rows are rows
        0 .. the last that decodes (a token each; one below it with nothing to decode runs its scratch token) and the
        chunk, if any, goes beside them; a chunk with no row decoding is the step's one row instead, the chunk inputs
        left empty (their row bound to its own, passed through). The rows sampled come back in run_slots' order."""
        rows, n_chunk = len(input_ids), len(chunk_ids)
        logits_index = np.asarray(logits_index, np.int64)
        decoding = logits_index < rows  # the rest are the chunk's
        chunk = np.ascontiguousarray(chunk_ids, dtype=np.int64).reshape(1, n_chunk)  # (1, T)
        chunk_positions = np.arange(chunk_start, chunk_start + n_chunk, dtype=np.int64)[None]  # (1, T)
        if decoding.any():
            count = int(logits_index[decoding].max()) + 1
            chunkless = self.chunkless_session is not None and n_chunk == 0 and (count == 1 or self.splits_steps)
            # no chunk: row 0, passed through (the chunkless graph has none)
            bound = self._bound_pool(pool, count, 0, None if chunkless else chunk_slot if n_chunk else 0, chunkless)
            tokens = np.asarray(input_ids[:count]).reshape(count, 1)  # (B, 1)
            positions = np.asarray(position_ids[:count]).reshape(count, 1)  # (B, 1)
            graph_index = np.where(decoding, logits_index, logits_index - rows + count)  # the chunk follows the B rows
            rows_long = np.zeros(count, np.int64) if long_rope is None else np.asarray(long_rope[:count])  # (B,)
        elif n_chunk:
            chunkless = self.chunkless_session is not None
            bound = self._bound_pool(pool, 1, chunk_slot, None if chunkless else chunk_slot, chunkless)
            tokens, positions, graph_index = chunk, chunk_positions, logits_index - rows
            chunk = chunk_positions = np.zeros((1, 0), np.int64)
            rows_long = np.array([int(chunk_long_rope)])  # (1,): the chunk is the one row
        else:
            raise ValueError("a step must decode a row or run a chunk")
        if self.long_rope:
            bound.set_input(io.LONG_ROPE, rows_long)
        bound.set_input(io.INPUT_IDS, tokens)
        bound.set_input(io.POSITION_IDS, positions)
        if not chunkless:  # the decode graph's chunk is an empty constant
            if self.long_rope:
                bound.set_input(io.CHUNK_LONG_ROPE, np.array([int(chunk_long_rope)]))  # (1,)
            bound.set_input(io.CHUNK_IDS, chunk)
            bound.set_input(io.CHUNK_POSITION_IDS, chunk_positions)
        bound.set_input(io.LOGITS_INDEX, graph_index)
        return self._run_sampled(bound, len(logits_index), with_logits, before_run)

    def prompt_length(self, longest: int, most: int) -> int:
        """The tokens each row of a prompt group whose longest prompt is `longest` runs (run_prompts), or a prompt chunk
        of `longest` tokens: a power of two of at least MIN_PROMPT_BUCKET where pads_prompts, never past most (the
        positions left in the row's context)."""
        if not self.pads_prompts:
            return longest
        return max(longest, min(most, max(MIN_PROMPT_BUCKET, 1 << (longest - 1).bit_length())))

    def run_prompts(self, pool: SlotPool, first_row: int, prompts: list, length: int, with_logits: bool = True,
                    before_run: Callable[[], None] | None = None, long_rope: np.ndarray | None = None) -> Sampled:
        """Fresh prompts, each whole from column 0, as the pool's rows first_row .. first_row + len(prompts) - 1 of one
        fused step, every one `length` tokens (prompt_length: the shorter ones' padding is written past their ends and
        never read); returns each prompt's last token's greedy token and logits, in order. long_rope (B,): the rows that
        turn long (a longrope graph's). The step graph runs them as its rows, no chunk beside them; a runtime that
        splits its steps has no step graph open, and its chunk graph always runs a chunk: the last prompt is that
        chunk there (so it takes two prompts at least). The decode graph cannot: its operators' total is the pool's
        width, which the operator takes for a past in every row."""
        if self.attention != io.FUSED:
            raise ValueError("several prompts prefill as rows of one step in a fused graph only")
        count = len(prompts)
        rows = count - 1 if self.splits_steps else count
        if rows < 1:
            raise ValueError("a runtime that splits its steps prefills two prompts at least as one step's rows and chunk")
        tokens = np.zeros((count, length), np.int64)  # (B, S): right-padded with token 0
        for i, ids in enumerate(prompts):
            tokens[i, : len(ids)] = ids
        positions = np.broadcast_to(np.arange(length, dtype=np.int64), (count, length))  # (B, S): each row from column 0
        logits_index = np.array([i * length + len(ids) - 1 for i, ids in enumerate(prompts)], np.int64)  # (B,) each one's last
        chunk_row = first_row + rows if self.splits_steps else first_row  # no chunk: its inputs empty, its row passed through
        bound = self._bound_pool(pool, rows, first_row, chunk_row)
        turns = np.zeros(count, np.int64) if long_rope is None else np.asarray(long_rope, np.int64)  # (B,)
        if self.long_rope:
            bound.set_input(io.LONG_ROPE, turns[:rows])  # (rows,)
            bound.set_input(io.CHUNK_LONG_ROPE, turns[rows:] if self.splits_steps else np.zeros(1, np.int64))  # (1,)
        bound.set_input(io.INPUT_IDS, tokens[:rows])  # (rows, S)
        bound.set_input(io.POSITION_IDS, positions[:rows])  # (rows, S)
        if self.splits_steps:
            chunk, chunk_positions = tokens[rows:], positions[rows:]  # (1, S): the last prompt
        else:
            chunk = chunk_positions = np.zeros((1, 0), np.int64)  # (1, 0): no chunk
        bound.set_input(io.CHUNK_IDS, chunk)
        bound.set_input(io.CHUNK_POSITION_IDS, chunk_positions)
        bound.set_input(io.LOGITS_INDEX, logits_index)
        return self._run_sampled(bound, count, with_logits, before_run)

    def _run_sampled(self, bound: BoundStep, n_logits: int, with_logits: bool, before_run: Callable[[], None] | None) -> Sampled:
        """Run a slots step whose greedy tokens (K,) and, when asked for, logits (K, V) land in host arrays bound up
        front: asking the binding for its outputs afterwards would wrap every bound K/V buffer too (121 objects a step
        for a 30-layer model). Logits not asked for stay where the step ran: on the CPU in one scratch array every kept
        binding writes them to (each binding's own would hold up to BINDINGS_KEPT copies of the largest), elsewhere in
        ONNX Runtime's buffer, which the binding's next step of as many rows reuses."""
        tokens = bound.greedy_output(n_logits)
        logits = None
        if with_logits:
            logits = np.empty((n_logits, self.vocab_size), np.float32)  # (K, V): the caller's to keep
            bound.binding.bind_output(io.LOGITS, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
            bound.unread_logits = None
            self.traffic.logits_bytes += logits.nbytes
        else:
            scratch = self._unread_logits
            if self.device == "cpu" and (scratch is None or len(scratch) < n_logits):
                scratch = self._unread_logits = np.empty((n_logits, self.vocab_size), np.float32)  # (K, V), never read
                self._unread_views.clear()
            held = bound.unread_logits
            if held is None or held[0] is not scratch or held[1] != n_logits:
                if self.device == "cpu":
                    view = self._unread_views.get(n_logits)
                    if view is None:  # its first n_logits rows, the same memory
                        view = self._unread_views[n_logits] = ort.OrtValue.ortvalue_from_numpy(scratch[:n_logits])
                    bound.binding.bind_ortvalue_output(io.LOGITS, view)
                else:
                    bound.binding.bind_output(io.LOGITS, self.device, 0)
                bound.unread_logits = (scratch, n_logits)  # holds the array it is bound to: a larger one may replace it
        if before_run is not None:
            before_run()
        settle_uploads(bound.device)  # inputs copied to the device land before the step reads them
        run_bound(bound.session, bound.binding, self._uncaptured)
        return Sampled(logits, tokens.copy())


class BoundStep:
    """An IO binding of pool rows (DecoderRuntime._bound_pool) and the host buffers bound to its inputs and greedy tokens,
    which a step of the same shapes writes into instead of binding new ones: right after a model call binding is slow
    (the weights streamed through the caches evicted what the binding calls touch: on a gpt2 int8 step, 246 µs from
    the start of run_slots to the model call, against 30 µs for a whole step's host work with the model call stubbed
    out). The buffers of the last SHAPES_KEPT shapes an input took stay made, so steps whose shapes come and go (a row
    checking 1 + k tokens, then one) rebind one but make none."""

    SHAPES_KEPT = 32

    def __init__(self, session: ort.InferenceSession, device: str):
        self.session, self.device = session, device  # the session that runs the step
        self.binding = session.io_binding()
        self.inputs: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # what each input is bound to now
        self._made: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, ort.OrtValue]] = {}  # (name, shape) -> its buffer
        self._greedy: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}  # count -> a host buffer of that many greedy tokens
        self.greedy_tokens: np.ndarray | None = None  # the one bound now
        self.chunk_row: int | None = None  # the pool row bound as a fused graph's chunk
        self.unread_logits: tuple | None = None  # (scratch array or None, rows) that logits not asked for are bound to

    def set_input(self, name: str, values: np.ndarray) -> None:
        """Bind values (int64, any shape) to input name: written into the buffer of that shape made before, if any
        (bound again when it is not the one bound now)."""
        bound = self.inputs.get(name)
        rebind = bound is None or bound[0].shape != values.shape
        if rebind:
            key = (name, values.shape)
            bound = self._made.pop(key, None)
            if bound is None:
                buffer = np.empty(values.shape, np.int64)  # the memory the binding reads, kept alive here
                bound = (buffer, ort.OrtValue.ortvalue_from_numpy(buffer, self.device, 0))  # on the CPU the same memory
                if len(self._made) >= self.SHAPES_KEPT:
                    del self._made[next(iter(self._made))]
            self._made[key] = bound  # the latest used last
            self.inputs[name] = bound
        buffer, value = bound
        buffer[...] = values
        if self.device != "cpu":  # bound as a device copy, which a write into the host buffer alone never reaches
            value.update_inplace(buffer)
        if rebind:
            self.binding.bind_ortvalue_input(name, value)

    def greedy_output(self, count: int) -> np.ndarray:
        """The host buffer the step's (count,) greedy tokens are bound to; zeros at first, so a stubbed-out run (the
        bench's host timing) leaves valid ids."""
        if self.greedy_tokens is None or len(self.greedy_tokens) != count:
            made = self._greedy.get(count)
            if made is None:
                tokens = np.zeros(count, np.int64)
                made = self._greedy[count] = (tokens, ort.OrtValue.ortvalue_from_numpy(tokens))  # host memory, shared
            self.greedy_tokens = made[0]
            self.binding.bind_ortvalue_output(io.GREEDY_TOKENS, made[1])
        return self.greedy_tokens
