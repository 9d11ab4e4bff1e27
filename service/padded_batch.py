"""The running batch of a `concat` or `inplace` artifact: rows right-aligned in one padded cache.

The batch's cache is P columns of (B, H, ., d_k) per layer and K/V, rows right-aligned: each row's newest
token sits in column P - 1 and shorter rows are left-padded (masked out by attention_mask). Position ids are
per row, so a row computes exactly what its sequence would alone. Between steps the cache stays where the
runtime put it (GPU memory under CUDA); it is reshaped through the host when rows join or leave. Whether
those P columns are the whole tensor (concat) or the front of a larger buffer written in place (inplace) is
the runtime's business (runtime.DeviceCache); every row writes column P. A prompt is prefilled whole in the
step it joins. The `slots` layout (kv_slots.py) does all of this better; these layouts stay servable for
artifacts exported for other tools.
"""

from __future__ import annotations

import numpy as np

from kvserve.export.io_contract import KV_SEQUENCE_AXIS
from kvserve.model.config import DecoderConfig

from .kv_slots import StepPlan, StepResults, advance_each
from .runtime import DecoderRuntime, DeviceCache
from .sequence import Sequence


def _stack_right_aligned(parts: list[np.ndarray], width: int, columns: int) -> np.ndarray:
    """Rows of several (B_i, H, S_i, d_k) caches -> one (sum B_i, H, columns, d_k) whose first width columns
    hold every row right-aligned (zero columns on the left), the rest zero: one pass over the data, since
    joins under load move the whole batch's cache."""
    rows = sum(p.shape[0] for p in parts)
    out = np.zeros((rows,) + parts[0].shape[1:2] + (columns,) + parts[0].shape[3:], dtype=parts[0].dtype)  # (B, H, C, d_k)
    start = 0
    for part in parts:
        out[start : start + part.shape[0], :, width - part.shape[KV_SEQUENCE_AXIS] : width] = part
        start += part.shape[0]
    return out


def _left_pad_mask(mask: np.ndarray, width: int) -> np.ndarray:
    """(B, S) -> (B, width) with zero (padding) columns on the left."""
    return np.pad(mask, ((0, 0), (width - mask.shape[1], 0)))


class PaddedBatch:
    """The rows of the running batch and their KV cache. Not thread-safe: one step thread calls it."""

    chunked = False  # a prompt is prefilled whole, in the step it joins
    fixed_decode = False  # decode steps run at their exact shapes (no CUDA graphs: see kv_slots.SlotBatch)

    def __init__(self, runtime: DecoderRuntime, config: DecoderConfig, max_rows: int):
        self.runtime = runtime
        self.config = config
        self.max_rows = max_rows
        self._joining: list[Sequence] = []
        self.rows: list[Sequence] = []
        self.past: DeviceCache | None = None  # P columns in use, each (B, H, P, d_k) or a larger buffer
        self.mask = np.zeros((0, 0), dtype=np.int64)  # (B, P): 1 where a row has a real token
        self._bytes_per_cell = 2 * config.n_layer * config.n_kv_head * config.d_head * np.dtype(runtime.kv_dtype).itemsize

    def kv_bytes(self) -> int:
        """Bytes of K/V held: B x capacity cells (padding and spare columns included) x K, V of every layer."""
        return len(self.rows) * self.row_bytes()

    def row_bytes(self) -> int:
        return (self.past.capacity if self.past is not None else 0) * self._bytes_per_cell

    def free_rows(self) -> int:
        return self.max_rows - len(self.rows)

    def run(self, plan: StepPlan) -> StepResults:
        """Decode every running row, then prefill the joining sequences whole (plan.chunk does not apply)."""
        return self.step([s for s in plan.joining if not s.cancelled])

    def step(self, admitted: list[Sequence]) -> StepResults:
        results: StepResults = []
        self._remove([s for s in self.rows if s.cancelled])
        if self.rows:
            results += self._decode()
        if admitted:
            self._joining = admitted  # held until they are rows, so a failure mid-step reaches them once
            results += self._prefill(admitted)
            self._joining = []
        self._remove([s for s in self.rows if s.finished])
        return results

    def close(self) -> None:
        """The batch is no longer used; the runtime holds nothing for it beyond its cache, which goes with it."""

    def fail_all(self, error: BaseException) -> StepResults:
        """Every sequence in the batch, or joining it in the step that failed, fails once with error."""
        failing = self.rows + [s for s in self._joining if s not in self.rows]
        self.rows, self.past, self.mask, self._joining = [], None, np.zeros((0, 0), dtype=np.int64), []
        return [(s, error) for s in failing]

    @staticmethod
    def _columns_ahead(rows: list[Sequence]) -> int:
        """Cache columns the rows' remaining decode steps will add: an inplace buffer sized for them never has
        to grow mid-flight (growing copies the whole batch's cache in one step, a pause every stream sees)."""
        return max((s.max_new_tokens - len(s.generated) for s in rows), default=0)

    def _decode(self):
        batch = len(self.rows)
        input_ids = np.array([[s.generated[-1]] for s in self.rows], dtype=np.int64)  # (B, 1)
        position_ids = np.array([[s.cached_tokens] for s in self.rows], dtype=np.int64)  # (B, 1)
        mask = np.concatenate([self.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)  # (B, P + 1)
        out = self.runtime.run(input_ids, mask, position_ids, self.past)
        self.past, self.mask = out.present, mask
        for seq in self.rows:
            seq.cached_tokens += 1
        return advance_each(self.rows, out.logits[:, -1, :])

    def _prefill(self, admitted: list[Sequence]):
        width = max(len(s.prompt_ids) for s in admitted)
        input_ids = np.zeros((len(admitted), width), dtype=np.int64)  # (B_new, T), left-padded
        mask = np.zeros((len(admitted), width), dtype=np.int64)  # (B_new, T)
        for row, seq in enumerate(admitted):
            input_ids[row, width - len(seq.prompt_ids) :] = seq.prompt_ids
            mask[row, width - len(seq.prompt_ids) :] = 1
        position_ids = np.maximum(mask.cumsum(axis=1) - 1, 0)  # (B_new, T): real tokens count from 0
        ahead = width + max(s.max_new_tokens for s in admitted)
        empty = self.runtime.empty_past(len(admitted), self.config.n_kv_head, self.config.d_head, room_for=ahead)
        out = self.runtime.run(input_ids, mask, position_ids, empty)
        for seq in admitted:
            seq.cached_tokens = len(seq.prompt_ids)
        results = advance_each(admitted, out.logits[:, -1, :])
        staying = [row for row, seq in enumerate(admitted) if not seq.finished]
        if staying:
            self._join([admitted[r] for r in staying], out.present, mask, staying)
        return results

    def _join(self, rows: list[Sequence], present: DeviceCache, mask: np.ndarray, keep: list[int]) -> None:
        """Append freshly prefilled rows to the batch, padding the narrower side on the left."""
        if not self.rows and len(keep) == mask.shape[0]:
            self.rows, self.mask, self.past = rows, mask, present  # the batch is just these rows: no copy
            return
        new = [a[keep] for a in self.runtime.to_host(present)]
        mask = mask[keep]
        if not self.rows:
            self.rows, self.mask = rows, mask
            self.past = self.runtime.to_device(new, room_for=self._columns_ahead(rows))
            return
        old = self.runtime.to_host(self.past)
        width = max(self.mask.shape[1], mask.shape[1])
        ahead = self._columns_ahead(self.rows + rows)
        columns = self.runtime.buffer_columns(width, ahead)
        stacked = [_stack_right_aligned([o, n], width, columns) for o, n in zip(old, new)]
        self.past = self.runtime.to_device(stacked, room_for=ahead, length=width)
        self.mask = np.concatenate([_left_pad_mask(self.mask, width), _left_pad_mask(mask, width)], axis=0)
        self.rows = self.rows + rows

    def _remove(self, leaving: list[Sequence]) -> None:
        """Free the rows of sequences that left, and the columns no remaining row uses."""
        if not leaving:
            return
        keep = [row for row, seq in enumerate(self.rows) if seq not in leaving]
        if not keep:
            self.rows, self.past, self.mask = [], None, np.zeros((0, 0), dtype=np.int64)
            return
        mask = self.mask[keep]
        first_used = int(np.argmax(mask.any(axis=0)))  # columns left of this are padding in every row
        self.rows = [self.rows[row] for row in keep]
        kept = [a[keep, :, first_used:] for a in self.runtime.to_host(self.past)]  # one copy
        self.past = self.runtime.to_device(kept, room_for=self._columns_ahead(self.rows))
        self.mask = mask[:, first_used:]
