#!/bin/sh
# The export image's job: export (unless an artifact from the same source is already there), then verify.
# Fails (non-zero) when the export or the parity check fails, so dependent services never start.
#   KVSERVE_MODEL              where the artifact goes (default /artifacts/model)
#   KVSERVE_EXPORT_CHECKPOINT  a transformers checkpoint directory of a model type kvserve exports (kvserve export --help), or
#   KVSERVE_EXPORT_PRESET      a preset (kvserve export --help lists them) when no checkpoint is given (default gpt2)
#   KVSERVE_EXPORT_DTYPE       float32 or float16 (default float32)
#   KVSERVE_EXPORT_KV_CACHE    slots or concat (default slots, the one kvserve serves; docs/kv-contract.md)
#   KVSERVE_EXPORT_QUANTIZE    int8 for 8-bit weights (docs/parity.md, "Int8"); empty for float weights (default)
#   KVSERVE_VERIFY_PROVIDER    provider for the parity check (default auto)
set -eu
out=${KVSERVE_MODEL:-/artifacts/model}
dtype=${KVSERVE_EXPORT_DTYPE:-float32}
kv_cache=${KVSERVE_EXPORT_KV_CACHE:-slots}
quantize=${KVSERVE_EXPORT_QUANTIZE:-}
if [ -n "${KVSERVE_EXPORT_CHECKPOINT:-}" ]; then
  set -- --checkpoint "$KVSERVE_EXPORT_CHECKPOINT"
else
  set -- --preset "${KVSERVE_EXPORT_PRESET:-gpt2}"
fi
if [ -n "$quantize" ]; then
  set -- "$@" --quantize "$quantize"
fi
stamp="$*|$dtype|$kv_cache"
if [ -f "$out/manifest.json" ] && [ "$(cat "$out.source" 2>/dev/null)" = "$stamp" ]; then
  echo "kvserve-export-job: $out already holds $stamp; verifying it"
else
  kvserve export "$@" --dtype "$dtype" --kv-cache "$kv_cache" --out "$out" --overwrite
  printf '%s' "$stamp" > "$out.source"
fi
kvserve verify "$out" --provider "${KVSERVE_VERIFY_PROVIDER:-auto}"
