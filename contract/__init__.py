"""The contract between export and serving, torch-free: the graph's I/O names and axes (io_contract.py), the
artifact directory and its checks (artifact.py), the parity tolerances (tolerances.py), and the artifact's
tokenizer (tokenizer.py). export/ writes what this describes, runtime/ and service/ read it; it imports neither.
"""
