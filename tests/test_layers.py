"""The folders are the architecture, and imports run one way (README, "Layout"):

    model (torch)      contract (no torch)      runtime (onnxruntime, no torch)
          \\                 |          \\           |
           export (torch) --+           service (no torch) -> kvserve.v1 (protobuf)

export never imports service; contract and runtime import neither; service, runtime and contract never import torch.
"""

import ast

import pytest

from .conftest import REPO

# folder -> the kvserve packages its modules may import
ALLOWED = {
    "contract": {"contract", "model.config", "model.hf_config", "errors"},
    "runtime": {"contract", "runtime", "model.config", "errors"},
    "export": {"contract", "runtime", "model", "export", "errors", "progress"},
    "service": {"contract", "runtime", "model.config", "service", "errors", "v1"},
}
TORCH_FREE = ("contract", "runtime", "service")


def imports_of(folder: str) -> dict[str, set[str]]:
    """{file: the modules it imports}, relative imports resolved to kvserve.<folder>.<name>."""
    found = {}
    for path in sorted((REPO / folder).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    names.add(f"kvserve.{folder}" + (f".{node.module}" if node.module else ""))
                else:
                    names.add(node.module)
        found[path.name] = names
    return found


@pytest.mark.parametrize("folder", list(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(folder):
    for file, names in imports_of(folder).items():
        for name in names:
            if name.startswith("kvserve."):
                inner = name.removeprefix("kvserve.")
                assert any(inner == allowed or inner.startswith(allowed + ".") for allowed in ALLOWED[folder]), \
                    f"{folder}/{file} imports {name}"
            if folder in TORCH_FREE:
                assert name.split(".")[0] not in ("torch", "onnx", "onnxscript", "transformers"), f"{folder}/{file} imports {name}"


def test_only_runtime_and_exports_graph_rewrites_import_onnxruntime():
    """Outside runtime/, only export's graph rewrites use onnxruntime's offline tools (quantizer, fusions); nothing
    else outside runtime/ opens a session."""
    users = {f"{folder}/{file}" for folder in ALLOWED for file, names in imports_of(folder).items()
             if any(name.split(".")[0] == "onnxruntime" for name in names)}
    assert {u for u in users if not u.startswith("runtime/")} <= {"export/quantize.py", "export/graph_fusions.py"}, users
