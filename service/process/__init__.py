"""The server process: its options (options.py), a model brought up (loading.py: the artifact, gate.py: the parity
gate and warm-up, kv_budget.py: the K/V memory), and app.py, which wires the engine to the edges and serves."""
