#!/usr/bin/env bash
# On a host with an NVIDIA GPU: parity on the CUDA provider (float32 and float16, tiny, gpt2 and tiny-llama presets),
# the service tests on CUDA, and the benchmarks on CUDA (CUDA graphs included). Writes its logs to ${RESULTS:-gpu-results}/.
#   bash bench/gpu_check.sh
set -uo pipefail
RESULTS=${RESULTS:-gpu-results}
ART=${ART:-/tmp/kvserve-gpu-artifacts}
mkdir -p "$RESULTS" "$ART"
PY=${PYTHON:-python3}
# It needs the project installed (make setup: kvserve's layers as packages, the test extras) with onnxruntime-gpu
# seeing the GPU; stop at once otherwise instead of failing every step.
$PY -c "import kvserve.runtime, jsonschema, onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()" 2>/dev/null \
  || { echo "gpu_check: $PY lacks the installed project, its test extras or onnxruntime-gpu's CUDA provider (run make setup on the GPU host)"; exit 2; }
status=0
step() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RESULTS/gpu.txt"
for dtype in float32 float16; do
  step $PY -m kvserve.cli export --preset tiny --dtype $dtype --out "$ART/tiny-$dtype" --provider cuda --overwrite 2>&1 | tee "$RESULTS/parity-tiny-$dtype.txt"
  step $PY -m kvserve.cli export --preset gpt2 --dtype $dtype --out "$ART/gpt2-$dtype" --provider cuda --overwrite 2>&1 | tee "$RESULTS/parity-gpt2-$dtype.txt"
  step $PY -m kvserve.cli export --preset gpt2 --dtype $dtype --kv-cache concat --out "$ART/gpt2-$dtype-concat" --provider cuda --overwrite 2>&1 | tee "$RESULTS/parity-gpt2-$dtype-concat.txt"
done
# Llama family: fused attention (GroupQueryAttention, float16 only on CUDA) and float32, which auto keeps standard there.
step $PY -m kvserve.cli export --preset tiny-llama --dtype float16 --out "$ART/tiny-llama-float16" --provider cuda --overwrite 2>&1 | tee "$RESULTS/parity-tiny-llama-float16-fused.txt"
step $PY -m kvserve.cli export --preset tiny-llama --dtype float32 --out "$ART/tiny-llama-float32" --provider cuda --overwrite 2>&1 | tee "$RESULTS/parity-tiny-llama-float32.txt"
step env KVSERVE_TEST_PROVIDER=cuda $PY -m pytest -q -p no:cacheprovider tests/service/test_generation.py tests/service/test_batch.py tests/service/test_scheduler.py tests/service/test_kv_rows.py tests/service/test_engine.py tests/service/test_prompt_cache.py tests/runtime tests/service/test_structured.py tests/service/test_fixed_decode.py tests/service/test_llama_serving.py tests/export/test_fused_graph.py tests/export/test_parity.py 2>&1 | tail -5 | tee "$RESULTS/tests-cuda.txt"
step $PY bench/decode_latency.py --provider cuda --artifact "$ART/gpt2-float32" 2>&1 | grep -v Loading | tee "$RESULTS/bench-decode-cuda-fp32.txt"
step $PY bench/decode_latency.py --provider cuda --artifact "$ART/gpt2-float16" 2>&1 | grep -v Loading | tee "$RESULTS/bench-decode-cuda-fp16.txt"
step $PY bench/grpc_load.py --provider cuda --artifact "$ART/gpt2-float32" 2>&1 | tee "$RESULTS/bench-grpc-cuda.txt"
step $PY bench/grpc_load.py --provider cuda --artifact "$ART/gpt2-float16" 2>&1 | tee "$RESULTS/bench-grpc-cuda-fp16.txt"
# CUDA graphs (serve --cuda-graph): decode steps captured per (rows, width) shape against uncaptured, in-process, both dtypes;
# then the 16-stream load over gRPC with them.
step $PY bench/cuda_graph_decode.py --provider cuda --artifact "$ART/gpt2-float16" 2>&1 | tee "$RESULTS/bench-cuda-graph-fp16.txt"
step $PY bench/cuda_graph_decode.py --provider cuda --artifact "$ART/gpt2-float32" 2>&1 | tee "$RESULTS/bench-cuda-graph-fp32.txt"
step $PY bench/grpc_load.py --provider cuda --artifact "$ART/gpt2-float16" --cuda-graph 2>&1 | tee "$RESULTS/bench-grpc-cuda-fp16-slots-graph.txt"
# Where CUDA and the CPU provider part, step by step, on a Llama-family graph in each attention.
step $PY bench/provider_diff.py --artifact "$ART/tiny-llama-float32" --prompt 24 --chunk 5 --steps 6 2>&1 | tee "$RESULTS/provider-diff-tiny-llama-float32.txt"
step $PY bench/provider_diff.py --artifact "$ART/tiny-llama-float16" --prompt 24 --chunk 5 --steps 6 --columns-over 0.1 2>&1 | tee "$RESULTS/provider-diff-tiny-llama-float16.txt"
# The prompt cache on and off, and a prefix copy between rows (cudaMemcpy2D) against the prefill it saves.
step $PY bench/prompt_cache.py --provider cuda --artifact "$ART/gpt2-float16" 2>&1 | tee "$RESULTS/bench-prompt-cache-cuda-fp16.txt"
# Structured output: 8 unconstrained streams beside 8 constrained ones on the GPU (the masks on the host, beside the step).
step $PY bench/structured.py --provider cuda --artifact "$ART/gpt2-float16" --parts load validity --validity "$ART/gpt2-float16" 2>&1 | tee "$RESULTS/bench-structured-cuda-fp16.txt"
step $PY bench/serving_latency.py --provider cuda --new "$ART/gpt2-float32" 2>&1 | tee "$RESULTS/bench-serving-cuda.txt"
exit $status
