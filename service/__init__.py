"""The serving side, flowing one way: the gRPC servicer (server.py: protobuf <-> domain) -> the engine and scheduler
(engine.py, scheduler.py: what each step runs) -> the batch and its KV slots (kv_slots.py: owns the cache and every
row move) -> ONNX Runtime (kvserve.runtime). loading.py brings a model up (artifact, parity gate, warm-up).

Nothing under service/ imports torch: the serving image carries ONNX Runtime only.
"""
