"""The serving side, in three folders, flowing one way (README, "Layout"):

- edges/: protocol <-> domain and nothing else. gRPC (grpc_servicer.py, grpc_errors.py), OpenAI HTTP (http_api.py
  over openai_protocol.py; the requests' shared parts openai_sampling.py, openai_chat.py, openai_responses.py, errors
  openai_errors.py, answers openai_answers.py; the connections http_connections.py, http_disconnect.py,
  http_responses.py, bounded_http.py), security.py, tracing.py, metrics.py and the gauges, kv_events.py (what routers
  are told), tokenizing.py, client.py.
- core/: requests -> steps. engine.py (admission, streams; validation.py: a request against the model and
  limits.py) -> scheduler.py (what each step runs, step_plan.py; it owns the rows, kv_rows.py: every row of the KV pool
  and every move of one, the prompt cache) -> batch.py (one model call a step over the rows a plan hands it) -> ONNX
  Runtime (kvserve.runtime); what a sequence is and how it takes its tokens (sequence.py, sampling.py, text.py,
  structured.py, tool_calls.py, reasoning.py, drafts.py).
- process/: the server process that wires them (app.py), its options (options.py), and bringing a model up
  (loading.py, gate.py: artifact, parity gate, warm-up; kv_budget.py).

core/ imports neither edges/ nor process/; edges/ reads the core's domain and process/options.py (tests/test_layers.py).
(vLLM splits its server alike: entrypoints/, engine/, core/.)
Nothing under service/ imports torch: the serving image carries ONNX Runtime only.

The modules' flat names from before the folders (kvserve.service.batch, kvserve.service.http_api, ...) still import:
each is the module in its folder, the same object (_FlatNames), so code written against them keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

FOLDERS = {
    "edges": ("bounded_http", "client", "gateway_gauges", "grpc_errors", "grpc_servicer", "http_api", "http_connections",
              "http_disconnect", "http_responses", "kv_events", "metrics", "openai_answers", "openai_chat", "openai_errors",
              "openai_protocol", "openai_responses", "openai_sampling", "security", "tokenizing", "tracing"),
    "core": ("batch", "drafts", "engine", "engine_errors", "kv_rows", "limits", "model_info", "prompt_cache", "reasoning",
               "sampling", "scheduler", "sequence", "step_plan", "structured", "text", "tool_call_text", "tool_calls",
               "validation"),
    "process": ("app", "gate", "kv_budget", "loading", "options"),
}
_FOLDER_OF = {module: folder for folder, modules in FOLDERS.items() for module in modules}


class _FlatNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """kvserve.service.<module> -> kvserve.service.<folder>.<module>: the same module object, imported once."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, module = fullname.rpartition(".")
        if package != __name__ or module not in _FOLDER_OF:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = spec.name.rpartition(".")[2]
        return importlib.import_module(f"{__name__}.{_FOLDER_OF[module]}.{module}")

    def exec_module(self, module):
        pass  # imported already, under its own name


if not any(isinstance(finder, _FlatNames) for finder in sys.meta_path):
    sys.meta_path.append(_FlatNames())
