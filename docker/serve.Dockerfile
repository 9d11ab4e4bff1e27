# syntax=docker/dockerfile:1
# The serving image: CUDA 13 + cuDNN 9 runtime, onnxruntime-gpu and the service. No torch.
#   docker build -f docker/serve.Dockerfile -t kvserve-serve .
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04

# Stage 1: generate the gRPC stubs from proto/ and build the kvserve wheel.
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
RUN pip install --no-cache-dir -c constraints.txt grpcio-tools
COPY proto ./proto
COPY kvserve ./kvserve
COPY model ./model
COPY contract ./contract
COPY runtime ./runtime
COPY export ./export
COPY service ./service
RUN python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/kvserve/v1/generation.proto \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

# Stage 2: the runtime, installed with the project's own pins.
# checkov reads the FROM line without its ARG, so it sees no tag; CUDA_IMAGE's default above is tagged exactly.
# checkov:skip=CKV_DOCKER_7:the base image is the tagged ARG CUDA_IMAGE, which checkov does not expand
FROM ${CUDA_IMAGE} AS serve
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY constraints.txt /tmp/constraints.txt
COPY --from=wheel /wheels /tmp/wheels
RUN python3 -m venv /opt/kvserve \
 && /opt/kvserve/bin/pip install --no-cache-dir -c /tmp/constraints.txt /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /tmp/constraints.txt
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvserve
USER kvserve
ENV PATH=/opt/kvserve/bin:$PATH \
    KVSERVE_MODEL=/artifacts/model \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=50051 \
    KVSERVE_METRICS_PORT=9400 \
    KVSERVE_PROVIDER=auto \
    KVSERVE_DRAIN_SECONDS=30
EXPOSE 50051 9400
# Speaks the gRPC health protocol: healthy only once the model passed its parity gate and warm-up.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["kvserve", "health", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["kvserve", "serve"]
