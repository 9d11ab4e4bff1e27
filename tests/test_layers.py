"""The folders are the architecture, and imports run one way (README, "Layout"):

    contract (no torch)  <-  model (torch)  <-  export (torch)  ->  runtime (onnxruntime, no torch)  <-  service (no torch)
                         <-------------------------------------------------------------------------  service

Every import of a kvserve module, wherever it stands (top of a file, inside a function, relative or absolute, a bare
`import kvserve`), is held to LAYERS; service/ takes from runtime/ only what runtime/__init__.py names, and its
folders import one way (SERVICE_FOLDERS); no two modules import each other, however indirectly; and importing every
module of service/, runtime/ and contract/ loads no torch.
"""

import ast
import subprocess
import sys

import pytest

from .conftest import REPO

# folder -> the import name its files have (pyproject.toml's package-dir)
PACKAGES = {"kvserve": "kvserve", "contract": "kvserve.contract", "model": "kvserve.model", "runtime": "kvserve.runtime",
            "export": "kvserve.export", "service": "kvserve.service"}
# The one table: folder -> the kvserve packages and modules its files may import (their own package always).
COMMON = {"kvserve.errors", "kvserve.progress"}
LAYERS = {
    "contract": COMMON,
    "model": COMMON | {"kvserve.contract"},
    "runtime": COMMON | {"kvserve.contract"},
    "export": COMMON | {"kvserve.contract", "kvserve.model", "kvserve.runtime"},
    "service": COMMON | {"kvserve.contract", "kvserve.runtime", "kvserve.v1"},
    "kvserve": COMMON | {"kvserve.contract", "kvserve.export", "kvserve.service", "kvserve.v1"},  # the command line
}
# Packages another layer may import only as a whole: what their __init__ names, nothing deeper.
PACKAGE_ONLY = {"service": {"kvserve.runtime"}}
TORCH_FREE = ("contract", "runtime", "service")
# Inside service/: folder -> the service modules outside it that its files may import (a folder: all of it). The core
# (engine, scheduler, rows, batch) knows no transport and no process; the edges read its domain and the server's options.
SERVICE_FOLDERS = {
    "core": set(),
    "edges": {"kvserve.service.core", "kvserve.service.process.options"},
    "process": {"kvserve.service.core", "kvserve.service.edges"},
}
HEAVY = ("torch", "transformers", "onnx", "onnxscript")


def module_name(folder: str, path) -> str:
    parts = path.relative_to(REPO / folder).with_suffix("").parts
    return ".".join([PACKAGES[folder], *(parts[:-1] if parts[-1] == "__init__" else parts)])


def relative(folder: str, path) -> str:
    return str(path.relative_to(REPO))


def imports_in(folder: str, path, top_level_only: bool = False) -> set[str]:
    """The modules a file imports, relative imports resolved; `from X import y` counts as X and X.y (y may be a module).
    top_level_only: only statements that run when the module is imported (its body, `if TYPE_CHECKING:` included)."""
    tree = ast.parse(path.read_text())
    package = module_name(folder, path).split(".")[: None if path.stem == "__init__" else -1]  # what `.` is for this file
    if top_level_only:
        nodes = []
        for node in tree.body:
            nodes += list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else [node]
    else:
        nodes = ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def source_files():
    for folder in LAYERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            yield folder, path


@pytest.mark.parametrize("folder", list(LAYERS))
def test_every_kvserve_import_is_one_the_table_allows(folder):
    own = PACKAGES[folder]
    allowed = LAYERS[folder] | ({own} if folder != "kvserve" else set())
    existing = {module_name(f, p) for f, p in source_files()} | set(PACKAGES.values()) | {"kvserve.v1"}
    for path in sorted((REPO / folder).rglob("*.py")):
        for name in imports_in(folder, path):
            if not name.startswith("kvserve"):
                continue
            if name not in existing and name.rsplit(".", 1)[0] in existing:
                name = name.rsplit(".", 1)[0]  # `from kvserve.x import a_function`: the module is kvserve.x
            if name == "kvserve":  # the package itself holds only its version, which any layer may read
                continue
            where = relative(folder, path)
            assert any(name == a or name.startswith(a + ".") for a in allowed), f"{where} imports {name}"
            for whole in PACKAGE_ONLY.get(folder, ()):
                assert not name.startswith(whole + ".") or name.startswith("kvserve.v1"), \
                    f"{where} imports {name}: take it from {whole} (its __init__ names what {folder}/ may use)"
            if folder in TORCH_FREE:
                assert name.split(".")[0] not in HEAVY, f"{where} imports {name}"


def test_the_service_folders_import_one_way_and_by_their_own_names():
    """core/ imports nothing from edges/ or process/; edges/ only the core and the options; and no file of the
    repository's code imports a service module by its flat name from before the folders (those are for outside code)."""
    from kvserve.service import FOLDERS

    assert set(FOLDERS) == set(SERVICE_FOLDERS)
    assert {p.stem for p in (REPO / "service").rglob("*.py") if p.stem != "__init__"} == {m for ms in FOLDERS.values() for m in ms}
    flat = {f"kvserve.service.{module}" for modules in FOLDERS.values() for module in modules}
    for folder in LAYERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            names = imports_in(folder, path)
            assert not names & flat, f"{relative(folder, path)} imports {sorted(names & flat)}: by its folder's name"
            if folder != "service" or path.parent == REPO / "service":
                continue
            own = path.parent.name
            allowed = SERVICE_FOLDERS[own] | {f"kvserve.service.{own}"}
            for name in names:
                if name.startswith("kvserve.service.") and name.split(".")[2] in SERVICE_FOLDERS:
                    assert any(name == a or name.startswith(a + ".") for a in allowed), f"{relative(folder, path)} imports {name}"


@pytest.mark.parametrize("folder", TORCH_FREE)
def test_torch_free_layers_import_no_heavy_package(folder):
    for path in sorted((REPO / folder).rglob("*.py")):
        heavy = {name for name in imports_in(folder, path) if name.split(".")[0] in HEAVY}
        assert not heavy, f"{relative(folder, path)} imports {sorted(heavy)}"


def test_importing_the_serving_layers_loads_no_torch():
    """What the serving image runs (service/, runtime/, contract/ and the command line) loads no torch, transformers or
    onnx when every one of its modules is imported: a dependency reached indirectly would show here."""
    modules = [module_name(folder, path) for folder, path in source_files() if folder in TORCH_FREE] + ["kvserve.cli"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_no_import_cycle():
    """The modules' own imports (what runs when each is imported, `if TYPE_CHECKING:` blocks included) form no circle."""
    graph = {}
    for folder, path in source_files():
        graph[module_name(folder, path)] = set()
    for folder, path in source_files():
        for name in imports_in(folder, path, top_level_only=True):
            if name in graph and name != module_name(folder, path):
                graph[module_name(folder, path)].add(name)
    for package in PACKAGES.values():  # a package's modules reach its __init__ first: not an edge back to it
        for module in graph:
            graph[module].discard(package) if module.startswith(package + ".") else None
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join(trail[trail.index(target):] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_only_runtime_and_exports_graph_rewrites_import_onnxruntime():
    """Outside runtime/, only export's graph rewrites use onnxruntime's offline tools (quantizer, fusions); nothing
    else outside runtime/ opens a session."""
    users = {relative(folder, path) for folder, path in source_files()
             if any(name.split(".")[0] == "onnxruntime" for name in imports_in(folder, path))}
    assert {u for u in users if not u.startswith("runtime/")} <= {"export/quantize.py", "export/graph_fusions.py"}, users


def test_scripts_and_benchmarks_use_the_installed_package():
    """scripts/ and bench/ import kvserve as installed: nothing links or copies its folders into place."""
    for path in sorted(list((REPO / "scripts").glob("*.py")) + list((REPO / "bench").glob("*.py"))):
        text = path.read_text()
        for linking in ("symlink_to(", "os.symlink(", "SUBPACKAGES"):
            assert linking not in text, f"{path.relative_to(REPO)} links folders by hand ({linking})"


def test_the_flat_service_names_are_the_modules_in_their_folders():
    """Code written against service/ before its folders imports the same module objects (one import, one state)."""
    import importlib

    from kvserve.service import FOLDERS

    for folder, modules in FOLDERS.items():
        for module in modules:
            assert importlib.import_module(f"kvserve.service.{module}") is importlib.import_module(f"kvserve.service.{folder}.{module}")
    from kvserve.service.engine import Engine  # the engine's module, not the folder
    from kvserve.service.core.engine import Engine as Moved

    assert Engine is Moved
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvserve.service.no_such_module")
