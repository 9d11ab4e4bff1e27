"""How close a quantized artifact stays to the float32 eager reference on real text.

Teacher-forced windows of held-out English (kvserve.model.corpus: chapters no model here was trained on),
tokenized with the artifact's own tokenizer (bytes when it has none): per position, whether the two argmax
tokens agree and the KL divergence KL(eager || onnx) of the next-token distributions; the perplexity of
each on the window's real next tokens; and from each window's opening, how many greedy tokens the artifact
produces before it first departs from the reference's.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.contract.tolerances import kl_of_log_probs, log_softmax, logit_blocks
from kvserve.model.corpus import load_corpus
from kvserve.model.decoders import Decoder

WINDOWS = 4
GREEDY_PROMPT_TOKENS = 16  # each window's opening the greedy comparison continues from
GREEDY_STEPS = 32
WINDOW_TOKENS = 128  # a window's positions, each predicting the next


def eval_windows(encode, vocab_size: int, n_ctx: int, count: int = WINDOWS, length: int = WINDOW_TOKENS) -> list[list[int]]:
    """count consecutive windows of length + 1 tokens from the start of the held-out text."""
    ids = encode("\n".join(load_corpus().held_out[: 2 * count]))
    length = min(length, n_ctx - 1)
    windows = [ids[i * length : i * length + length + 1] for i in range(count)]
    if len(windows[-1]) < length + 1 or max(max(w) for w in windows) >= vocab_size:
        raise ValueError("the held-out text does not fill the evaluation windows with ids of this vocabulary")
    return windows


class DistributionComparison:
    """Teacher-forced positions of both sides' logits, compared a window at a time and summed up: only one window's
    (T, V) logits are held (the four windows' together put 0.8 GB on a Qwen3-4B verify's peak: 5.00 GB against 4.22,
    bench/large_export.py)."""

    def __init__(self):
        self.kl, self.target_q, self.target_p, self.same_top1 = [], [], [], []

    def add(self, onnx_logits: np.ndarray, eager_logits: np.ndarray, targets: np.ndarray) -> None:
        """Both (N, V) over the same N positions; targets (N,) the real next tokens. A block of rows at a time
        (tolerances.py)."""
        for rows in logit_blocks(len(targets)):
            log_q, log_p = log_softmax(onnx_logits[rows]), log_softmax(eager_logits[rows])  # (n, V) each
            self.kl.append(kl_of_log_probs(log_p, log_q))  # (n,): KL(eager || onnx)
            picked = np.arange(len(log_q)), np.asarray(targets[rows])
            self.target_q.append(log_q[picked])
            self.target_p.append(log_p[picked])
        self.same_top1.append(onnx_logits.argmax(-1) == eager_logits.argmax(-1))

    def result(self) -> dict:
        kl = np.concatenate(self.kl)
        return {
            "positions": int(len(kl)),
            "top1_agreement": float(np.concatenate(self.same_top1).mean()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "perplexity_onnx": float(np.exp(-np.concatenate(self.target_q).mean())),
            "perplexity_eager": float(np.exp(-np.concatenate(self.target_p).mean())),
        }


def greedy_tokens(driver, prompts: list[list[int]], steps: int) -> np.ndarray:
    """ONNX Runtime's own greedy loop through a parity driver: (B, steps) tokens."""
    logits = np.stack([row[-1] for row in driver.prefill(prompts)])  # (B, V)
    tokens = []
    for step in range(steps):
        tokens.append(logits.argmax(-1))  # (B,)
        if step < steps - 1:
            logits = driver.decode(tokens[-1])
    return np.stack(tokens, axis=1)


@torch.no_grad()
def text_quality(driver, reference: Decoder, windows: list[list[int]]) -> dict:
    """driver: a parity driver (prefill returns each row's logits at every position; decode one token a row)."""
    comparison = DistributionComparison()
    for window in windows:
        ids = torch.tensor([window[:-1]])  # (1, T)
        (onnx_logits,) = driver.prefill(ids.tolist())  # (T, V)
        eager_logits, _ = reference(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], reference.empty_cache(1))  # (1, T, V)
        comparison.add(onnx_logits, eager_logits[0].numpy(), np.asarray(window[1:]))
        del onnx_logits, eager_logits
    result = comparison.result()
    result["perplexity_ratio"] = result["perplexity_onnx"] / result["perplexity_eager"]

    greedy_steps = min(GREEDY_STEPS, reference.config.n_ctx - GREEDY_PROMPT_TOKENS - 1)
    prompts = [w[:GREEDY_PROMPT_TOKENS] for w in windows]
    onnx_tokens = greedy_tokens(driver, prompts, greedy_steps)  # (B, N)
    # The eager model's greedy tokens up to the first difference are its argmax over the ONNX tokens before each: one
    # teacher-forced pass says how far the two agree, where generating them took a pass a token (33 passes of a streamed
    # 4 B reference: 160 s of its export).
    ids = torch.cat([torch.tensor(prompts), torch.from_numpy(onnx_tokens[:, :-1])], dim=1)  # (B, P + N - 1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    forced, _ = reference(ids, torch.ones_like(ids), positions, reference.empty_cache(len(prompts)))  # (B, P + N - 1, V)
    eager_tokens = forced[:, GREEDY_PROMPT_TOKENS - 1 :].argmax(-1).numpy()  # (B, N): eager's next token after each ONNX prefix
    same = np.cumprod(onnx_tokens == eager_tokens, axis=1).sum(axis=1)  # per row: tokens before the first difference
    result["greedy_steps"] = greedy_steps
    result["greedy_prefix"] = [int(n) for n in same]
    return result
