#!/usr/bin/env bash
# The main job on the built-in default model: export + verify, serve, stream one generation, stop.
# Called by `make demo`; expects the virtual environment that `make setup` builds.
set -euo pipefail
BIN=${BIN:-.venv/bin}
PRESET=${PRESET:-tiny}
ARTIFACT=${ARTIFACT:-artifacts/$PRESET}
PORT=${PORT:-50051}
PROMPT=${PROMPT:-Hello, kvserve!}

echo "== 1/4 export the $PRESET preset to $ARTIFACT and verify it against the eager model"
"$BIN/kvserve" export --preset "$PRESET" --out "$ARTIFACT" --overwrite

echo "== 2/4 start the server on 127.0.0.1:$PORT"
"$BIN/kvserve" serve --model "$ARTIFACT" --port "$PORT" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
"$BIN/kvserve" health --target "127.0.0.1:$PORT" --wait 60 >/dev/null

echo "== 3/4 stream a generation (random weights: expect gibberish, byte by byte)"
"$BIN/kvserve" generate --target "127.0.0.1:$PORT" --max-new-tokens 48 "$PROMPT"

echo "== 4/4 stop the server (SIGTERM: drain, then exit 0)"
kill -TERM "$server"
wait "$server"
trap - EXIT
echo "done"
