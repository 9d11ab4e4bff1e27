"""transformers as the independent reference: the same padded batch through both models, and its own generate."""

import numpy as np
import torch

from kvserve.model.generate import left_pad, position_ids_from_mask

# transformers' config and model class names of each Llama-family model_type the tests build
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
              "phi3": ("Phi3Config", "Phi3ForCausalLM"), "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM")}


@torch.no_grad()
def padded_logits_gap(hf, ours, prompts: list[list[int]], relative: bool = False) -> float:
    """Largest |ours - transformers| logit over the real positions of a left-padded batch of prompts; relative: divided by
    the largest |logit|."""
    input_ids, attention_mask = left_pad(prompts)  # (B, T), rows padded on the left
    position_ids = position_ids_from_mask(attention_mask)
    theirs = hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    mine, _ = ours(input_ids, attention_mask, position_ids, ours.empty_cache(len(prompts)))
    real = attention_mask.bool()
    assert theirs[real].abs().max() > 0.5  # logits with a spread, not a model that says nothing
    gap = (mine[real] - theirs[real]).abs().max().item()
    return gap / theirs[real].abs().max().item() if relative else gap


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], steps: int) -> np.ndarray:
    """transformers' own generate on a left-padded batch, never stopping early: (B, steps). A longrope model's prompts go
    one at a time: transformers turns a whole batch long once its longest row passes the original context, so a row's
    tokens would depend on what it is batched with (kvserve's, and a lone prompt's in transformers, do not)."""
    parameters = getattr(hf.config, "rope_parameters", None) or {}
    if parameters.get("rope_type") == "longrope" and len(prompts) > 1:
        return np.concatenate([hf_greedy(hf, [prompt], steps) for prompt in prompts])
    input_ids, attention_mask = left_pad(prompts)
    out = hf.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, input_ids.shape[1]:].numpy()


@torch.no_grad()
def hf_greedy_logits(hf, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """transformers' own generate on one prompt, never stopping early: its tokens and the logits behind each."""
    out = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=steps,
                      do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [logits[0].numpy() for logits in out.logits]
