"""kvserve: causal decoders exported to ONNX with their KV cache as graph I/O, checked for parity, served over gRPC and
an OpenAI-compatible HTTP API.

Its layers live in the repository's top-level folders (pyproject.toml's package-dir): kvserve.contract (contract/),
kvserve.model (model/), kvserve.runtime (runtime/), kvserve.export (export/), kvserve.service (service/); this folder
holds the command line (cli.py), the shared errors and progress lines, and kvserve.v1, the stubs generated from proto/.
"""

__version__ = "0.1.0"
