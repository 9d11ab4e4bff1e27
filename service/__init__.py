"""The serving side: gRPC servicer (server.py) -> engine (engine.py) -> ONNX Runtime (runtime.py).

Nothing under service/ imports torch: the serving image carries ONNX Runtime only.
"""
