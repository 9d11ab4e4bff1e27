"""The contract between export and serving, torch-free: the decoder config (config.py) and its config.json mapping
(hf_config.py), the graph's I/O names and axes (io_contract.py), the artifact directory and its checks (artifact.py),
the parity tolerances (tolerances.py), and what an artifact ships for text: its tokenizer (tokenizer.py) and chat
template (chat.py). export/ writes what this describes, model/ builds from its config, runtime/ and service/ read
it; it imports none of them.
"""
