"""The two ways an artifact's graph is driven for parity, each through kvserve.runtime (which opens and runs the
session): a slots graph as the server runs it (SlotsDriver: a row per sequence, prompts in chunks, rows decoding
together), a concat graph as Optimum-style tools do (ConcatDriver: a left-padded batch, each step's present fed back
as past). Both answer prefill, decode and kv the same way, so parity.py's checks read either."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from kvserve.contract import io_contract as io
from kvserve.contract.artifact import open_artifact
from kvserve.model.generate import left_pad, position_ids_from_mask
from kvserve.runtime import DecoderRuntime, pool_capacity

from .quality import greedy_tokens

# The most columns a parity row holds: more than any check feeds it (verify's --steps is bounded by it), and few enough
# that a 40,960-token model's four rows take 1 GB of K/V, not the 38 GB of four whole contexts.
DRIVEN_COLUMNS = 2048


class ConcatDriver:
    """Drives a concat graph the way Optimum-style tools do: a left-padded batch, each step's present fed back as past.
    A Phi-3 longrope model's batch is computed again, whole, at the step where a row first grows past the original
    context, as transformers' Phi-3 does (the graph turns each row by its last position)."""

    argmax_rows = argmax_mismatches = 0  # a concat graph has no greedy_tokens output to check

    def __init__(self, runtime: DecoderRuntime, config):
        self.runtime, self.config = runtime, config
        self.past_names = [name for layer in range(config.n_layer) for name in io.past_names(layer)]

    def _run(self, ids, past) -> np.ndarray:
        feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: self.mask.numpy(), io.POSITION_IDS: self.pos.numpy(), **dict(zip(self.past_names, past))}
        logits, *self.past = self.runtime.run_feeds(feeds)
        return logits  # (B, T, V)

    def _empty(self, rows: int) -> list[np.ndarray]:
        return [np.zeros((rows, self.config.n_kv_head, 0, self.config.d_head), self.runtime.kv_dtype)] * len(self.past_names)  # (B, H_kv, 0, d_k)

    def prefill(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Prompts from an empty cache; returns each row's logits at every prompt position, (L_r, V)."""
        self.ids, self.mask = left_pad(prompts)  # (B, T)
        self.pos = position_ids_from_mask(self.mask)
        logits = self._run(self.ids.numpy(), self._empty(len(prompts)))
        real = self.mask.numpy().astype(bool)
        return [logits[row][real[row]] for row in range(len(prompts))]

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """One token per row (B,); returns the next-token logits (B, V)."""
        tokens = np.asarray(tokens, np.int64)[:, None]  # (B, 1)
        self.ids = torch.cat([self.ids, torch.from_numpy(tokens)], dim=1)  # (B, P + 1)
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.int64)], dim=1)  # (B, P + 1)
        self.pos = self.pos[:, -1:] + 1  # (B, 1)
        recompute_at = self.config.long_rope_recompute_at
        if recompute_at is not None and (self.pos == recompute_at).any():  # a Phi-3 row crosses: every row's cache again, whole
            self.pos = position_ids_from_mask(self.mask)
            logits = self._run(self.ids.numpy(), self._empty(len(tokens)))[:, -1]
            self.pos = self.pos[:, -1:]
            return logits
        return self._run(tokens, self.past)[:, -1]

    def kv(self) -> list[list[np.ndarray]]:
        real = self.mask.numpy().astype(bool)
        return [[a[row][:, real[row]] for a in self.past] for row in range(real.shape[0])]


class SlotsDriver:
    """Drives a slots graph as the server does: a row per sequence, prompts prefilled a chunk at a time (the
    chunk's logits kept at every position, so parity still sees them all), then every row decoding at once. A longrope
    model's row turns long when its sequence is longer than the original context, and (Phi-3) is prefilled again, whole,
    at the step where it first grows past it (the server's scheduler does the same); long_rope=True turns every row long."""

    CHUNK = 5  # prompt tokens per step: every prompt of more than 5 tokens crosses a chunk boundary

    def __init__(self, runtime: DecoderRuntime, config, capacity: int, kv_scales: tuple[np.ndarray, np.ndarray] | None = None):
        """kv_scales: an int8 pool's K and V scales, each (L, H_kv, d_k), which kv() reads its rows back with."""
        self.runtime, self.config, self.capacity, self.kv_scales = runtime, config, capacity, kv_scales
        self.argmax_rows = self.argmax_mismatches = 0  # the graph's greedy_tokens against its logits' argmax
        self.long_rope = False
        self.chunk = self.CHUNK
        self.fixed_decode = False  # decode steps through the runtime's fixed-shape path (a fused artifact's decode graph)

    @contextlib.contextmanager
    def chunks_of(self, tokens: int):
        """Prefill in chunks of tokens within the block: checks that only read logits (the held-out text's 512
        positions) need not cross a boundary every 5 tokens, a step each (the prefill checks do)."""
        self.chunk = tokens
        try:
            yield self
        finally:
            self.chunk = self.CHUNK

    def _run(self, tokens, positions, chunk=(), start=0, slot=0, logits_index=()):
        width = self._decode_width(positions) if self.decoding else 1
        mask = (np.arange(width)[None, :] <= positions[:, None]).astype(np.int64)  # (B, W)
        sampled = self.runtime.run_slots(self.pool, tokens, positions, mask, np.asarray(chunk, np.int64), start, slot,
                                         np.asarray(logits_index, np.int64), long_rope=self.long.astype(np.int64),
                                         chunk_long_rope=bool(self.long[slot]))
        self.argmax_rows += len(sampled.greedy_tokens)
        self.argmax_mismatches += int((sampled.greedy_tokens != sampled.logits.argmax(-1)).sum())
        return sampled.logits

    def _decode_width(self, positions: np.ndarray) -> int:
        """Columns a decode step's rows read: up to the longest real row's (a scratch token reads nothing it needs; a ring
        graph's runs past the pool's width)."""
        return min(int(positions[positions != self.pool.scratch].max(initial=0)) + 1, self.capacity)

    def _run_fixed(self, tokens, positions):
        """A decode step through run_decode, every row's logits: what `serve --cuda-graph` runs (and captures)."""
        width = self._decode_width(positions)
        mask = None if self.runtime.attention == io.FUSED else (np.arange(width)[None, :] <= positions[:, None]).astype(np.int64)
        sampled = self.runtime.run_decode(self.pool, tokens, positions, mask, long_rope=self.long.astype(np.int64))
        logits = sampled.logits.copy()  # the fixed step's own buffer on the CPU provider: the next step overwrites it
        self.argmax_rows += len(sampled.greedy_tokens)
        self.argmax_mismatches += int((sampled.greedy_tokens != logits.argmax(-1)).sum())
        return logits

    def _turns_long(self, length: int) -> bool:
        after = self.config.long_rope_after
        return after is not None and (self.long_rope or length > after)

    def _prefill_row(self, row: int, tokens: list[int]) -> np.ndarray:
        """Row's tokens from its first column, a chunk a step, the other rows idle: their logits (L, V)."""
        rows = len(self.sequences)
        scratch_tokens, scratch = np.zeros(rows, np.int64), np.full(rows, self.pool.scratch, np.int64)
        decoding, self.decoding = self.decoding, False
        pieces = [np.zeros((0, self.config.vocab_size), np.float32)]  # (0, V): a row joining later has no prompt yet
        for start in range(0, len(tokens), self.chunk):
            chunk = tokens[start : start + self.chunk]
            pieces.append(self._run(scratch_tokens, scratch, chunk, start, row, rows + np.arange(len(chunk))))
        self.decoding = decoding
        return np.concatenate(pieces)

    def prefill(self, prompts: list[list[int]]) -> list[np.ndarray]:
        rows = len(prompts)
        self.pool = self.runtime.new_pool(rows, self.config.n_kv_head, self.config.d_head, self.capacity)
        self.sequences = [list(p) for p in prompts]
        self.lengths = np.array([len(p) for p in prompts])
        self.long = np.array([self._turns_long(len(p)) for p in prompts])  # (B,)
        self.decoding = False
        return [self._prefill_row(row, prompt) for row, prompt in enumerate(prompts)]  # each (L_r, V)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        if self.lengths.max() >= self.capacity - 1:  # the last column is the scratch one
            raise ValueError(f"a parity row holds {self.capacity - 1} tokens; this check feeds more")
        self.decoding = True
        tokens = np.asarray(tokens, np.int64)
        for sequence, token in zip(self.sequences, tokens.tolist()):
            sequence.append(token)
        crossing = [row for row, length in enumerate(self.lengths) if not self.long[row] and self._turns_long(length + 1)]
        self.long[crossing] = True
        if self.config.long_rope_recompute_at is None:  # the rows turn long from this token on, their caches kept
            crossing = []
        recomputed = {}
        for row in crossing:  # its cache turned short: every token again, long
            recomputed[row] = self._prefill_row(row, self.sequences[row])[-1]
        positions = self.lengths.copy()
        positions[crossing] = self.pool.scratch  # recomputed rows decode a scratch token
        if self.fixed_decode:
            out = self._run_fixed(tokens, positions)
        else:
            out = self._run(tokens, positions, logits_index=np.arange(len(tokens)))
        for row, logits in recomputed.items():
            out[row] = logits
        self.lengths += 1
        return out

    def decode_beside_chunk(self, tokens: np.ndarray, chunk: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """One step of every row but the last decoding tokens (B - 1,) and the last row's next prompt chunk beside them,
        as a prompt joining a running batch runs (the last row runs a scratch token): their logits (B - 1, V) and the
        chunk's (T, V)."""
        joining = len(self.sequences) - 1
        tokens = np.asarray(tokens, np.int64)
        for sequence, token in zip(self.sequences, tokens.tolist()):
            sequence.append(token)
        start = int(self.lengths[joining])
        positions = np.append(self.lengths[:joining], self.pool.scratch)  # (B,)
        self.decoding = True
        logits_index = np.concatenate([np.arange(joining), joining + 1 + np.arange(len(chunk))])  # the rows', then the chunk's
        out = self._run(np.append(tokens, 0), positions, chunk, start, joining, logits_index)
        self.sequences[joining].extend(chunk)
        self.lengths[:joining] += 1
        self.lengths[joining] += len(chunk)
        return out[:joining], out[joining:]

    def kv(self) -> list[list[np.ndarray]]:
        """Per row, per layer K then V, each (H_kv, L_r, d_k) as attention read them (SlotPool.read_row)."""
        return [self.pool.read_row(row, int(length), self.kv_scales) for row, length in enumerate(self.lengths)]


def artifact_greedy(artifact_dir: str | Path, prompts: list[list[int]], steps: int, provider: str = "auto") -> np.ndarray:
    """The artifact's own greedy continuation of prompts, (B, steps): a slots artifact a row per prompt as the
    server runs it, a concat one as one left-padded batch, Optimum-style."""
    artifact = open_artifact(artifact_dir)
    runtime = DecoderRuntime(artifact.model_path, artifact.config.n_layer, artifact.dtype, provider)
    return greedy_tokens(driver_for(runtime, artifact), prompts, steps)


def driver_for(runtime: DecoderRuntime, artifact, columns: int = DRIVEN_COLUMNS):
    """The driver that runs artifact's layout as its users do; a slots one's rows hold columns tokens (and a scratch column)."""
    if artifact.kv_cache == io.SLOTS:
        return SlotsDriver(runtime, artifact.config, min(pool_capacity(artifact.config), min(columns, DRIVEN_COLUMNS) + 1), artifact.kv_scales())
    return ConcatDriver(runtime, artifact.config)
