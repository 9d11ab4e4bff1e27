"""The serving side, flowing one way (README, "Layout"): the edges translate and nothing else, gRPC (grpc_servicer.py,
grpc_errors.py) and OpenAI HTTP (http_api.py over openai_protocol.py, the requests: shared openai_sampling.py, openai_chat.py,
openai_responses.py, errors openai_errors.py; and openai_answers.py) -> the
engine (engine.py: admission, streams; validation.py: a request against the model and limits.py) -> the scheduler
(scheduler.py: what each step runs, step_plan.py; it owns the rows, kv_rows.py: every row of the KV pool and every
move of one, the prompt cache) -> the batch (batch.py: one model call a step over the rows a plan hands it) -> ONNX
Runtime (kvserve.runtime).
app.py is the process that wires them; loading.py and gate.py bring a model up (artifact, parity gate, warm-up).

Nothing under service/ imports torch: the serving image carries ONNX Runtime only.
"""
