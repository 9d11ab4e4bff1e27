"""The eager PyTorch reference: the GPT-2 and Llama-family decoders (gpt2.py, llama.py) over the shared attention
and per-layer KV cache (attention.py), decoders.py to pick one, named presets (presets.py), checkpoints
(checkpoint.py), reference generation (generate.py) and the default model's training (train.py). Its config and
config.json mapping are the contract's (kvserve.contract.config, kvserve.contract.hf_config): only export/ imports
this package.
"""
