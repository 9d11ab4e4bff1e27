"""ONNX export of the reference decoder, the artifact format, and the parity harness.

Kept free of imports here: service/ reads io_contract and artifact without pulling in torch.
"""
