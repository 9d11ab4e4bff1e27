"""kvserve: GPT-2 and Llama-family decoders, exported to ONNX with their KV cache as graph I/O and served over gRPC.

Subpackages live in the repository's top-level folders: kvserve.model (model/), kvserve.export (export/),
kvserve.service (service/); kvserve.v1 holds the stubs generated from proto/.
"""

__version__ = "0.1.0"
