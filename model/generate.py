"""Reference generation with the eager model: prefill once, then one cached decode step per token.

This is the yardstick the ONNX export and the server are held to, so it stays plain: greedy (argmax) or
seeded sampling (temperature, top-k, top-p), fixed step count, left-padded batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decoders import Decoder


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts of different lengths, padded on the left so every row's last token is at the end.

    Returns input_ids (B, T) and attention_mask (B, T) with 0 on the padding.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)  # (B, T)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)  # (B, T)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a padded row sees the positions it would see alone."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, N) generated token ids
    step_logits: torch.Tensor  # (N, B, V) the logits each token was chosen from


def _choose(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """logits (B, V) float32 -> next tokens (B,)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(
    model: Decoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Generation:
    """Generate exactly max_new_tokens for every prompt (no early stop), using the KV cache. A Phi-3 longrope model's
    cache is computed again, whole, at the step where a row first grows past the original context (its K turn by the
    long factors from there on: transformers' Phi-3 does the same; its other longrope models turn the new tokens only)."""
    n_ctx = model.config.n_ctx
    if max(len(p) for p in prompts) + max_new_tokens > n_ctx + 1:
        raise ValueError(f"prompt + max_new_tokens exceeds the context length ({n_ctx})")
    generator = torch.Generator().manual_seed(seed)
    param = next(model.parameters())
    input_ids, attention_mask = left_pad(prompts)
    input_ids, attention_mask = input_ids.to(param.device), attention_mask.to(param.device)
    position_ids = position_ids_from_mask(attention_mask)
    past = model.empty_cache(len(prompts))
    logits, past = model(input_ids, attention_mask, position_ids, past)  # prefill
    next_logits = logits[:, -1, :]  # (B, V)
    tokens, step_logits = [], []
    recompute_at = model.config.long_rope_recompute_at
    for step in range(max_new_tokens):
        token = _choose(next_logits.float().cpu(), temperature, top_k, top_p, generator)  # (B,)
        tokens.append(token)
        step_logits.append(next_logits.float().cpu())
        if step == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], dim=1)  # (B, P + 1)
        input_ids = torch.cat([input_ids, token[:, None].to(param.device)], dim=1)  # (B, P + 1): every token so far
        position_ids = position_ids[:, -1:] + 1  # (B, 1)
        if recompute_at is not None and (position_ids == recompute_at).any():  # a Phi-3 row crosses: recompute every row's cache
            logits, past = model(input_ids, attention_mask, position_ids_from_mask(attention_mask), model.empty_cache(len(prompts)))
        else:
            logits, past = model(token[:, None].to(param.device), attention_mask, position_ids, past)  # decode
        next_logits = logits[:, -1, :]
    return Generation(tokens=torch.stack(tokens, dim=1), step_logits=torch.stack(step_logits))
