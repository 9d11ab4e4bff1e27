"""ONNX export of the reference decoder (onnx_export.py, fused_graph.py, graph_fusions.py, quantize.py), the export
pipeline (pipeline.py), and the parity harness: the checks (parity.py), the drivers that run an artifact's graph
through kvserve.runtime (parity_drivers.py), the report (parity_report.py) and held-out text (quality.py).
Imports kvserve.contract, kvserve.model and kvserve.runtime, never kvserve.service.
"""
