"""ONNX Runtime under kvserve, torch-free: which provider runs and why (providers.py), the KV pool and what moves
through the host (pool.py), one slots step for standard and fused graphs (step.py), and decode steps at fixed
shapes captured as CUDA graphs (cuda_graphs.py). The server's batch (service/kv_slots.py) and export's parity
driver (export/parity.py) both run their steps here.
"""
