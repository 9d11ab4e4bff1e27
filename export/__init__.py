"""ONNX export of the reference decoder (onnx_export.py, fused_graph.py, quantize.py), the export pipeline
(pipeline.py) and the parity harness (parity.py, quality.py). Imports kvserve.contract and kvserve.runtime, never
kvserve.service.
"""
