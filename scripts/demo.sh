#!/usr/bin/env bash
# The main job on the built-in default model: export + verify, serve, stream one generation, stop.
# Called by `make demo`, which builds the virtual environment and the stubs it uses. The default model is the
# small GPT-2 trained on the King James Bible that the repository ships (checkpoints/kjv-gpt2, made by
# model/train.py); MODEL=DIR exports another checkpoint, PRESET=NAME a preset with random weights (tiny, gpt2,
# tiny-llama, llama-135m).
set -euo pipefail
BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-checkpoints/kjv-gpt2}
PORT=${PORT:-50051}
PROMPT=${PROMPT:-And the LORD said unto Moses,}
if [ -n "${PRESET:-}" ]; then
  source=(--preset "$PRESET"); name="the $PRESET preset"; ARTIFACT=${ARTIFACT:-${ARTIFACTS:-artifacts}/$PRESET}
else
  source=(--checkpoint "$MODEL"); name="$MODEL"; ARTIFACT=${ARTIFACT:-${ARTIFACTS:-artifacts}/$(basename "$MODEL")}
fi

echo "== 1/6 export $name to $ARTIFACT and verify it against the eager model"
"$BIN/kvserve" export "${source[@]}" --out "$ARTIFACT" --overwrite

echo "== 2/6 start the server on 127.0.0.1:$PORT"
"$BIN/kvserve" serve --model "$ARTIFACT" --port "$PORT" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
# Ready when its health service says SERVING; a server that exits first (a taken port, say) ends the demo at once.
for _ in $(seq 300); do
  if ! kill -0 "$server" 2>/dev/null; then
    wait "$server" || true
    echo "the server did not start (its error is above); to use another port: make demo PORT=50052" >&2
    trap - EXIT
    exit 2
  fi
  if "$BIN/kvserve" health --target "127.0.0.1:$PORT" >/dev/null 2>&1; then break; fi
  sleep 0.2
done
"$BIN/kvserve" health --target "127.0.0.1:$PORT" >/dev/null

echo "== 3/6 stream a continuation of: $PROMPT"
"$BIN/kvserve" generate --target "127.0.0.1:$PORT" --max-new-tokens 48 --temperature 0.8 --seed 7 "$PROMPT"

if [ -f "$ARTIFACT/chat_template.jinja" ]; then
  echo "== 4/6 the same model in a conversation, rendered by its chat template ($ARTIFACT/chat_template.jinja)"
  "$BIN/kvserve" generate --target "127.0.0.1:$PORT" --chat --system "${SYSTEM:-Answer in the words of scripture.}" \
    --max-new-tokens 32 --temperature 0.8 --seed 7 "${QUESTION:-Who led the children of Israel out of Egypt?}"
else
  echo "== 4/6 no chat template in $ARTIFACT: no conversation to show"
fi

echo "== 5/6 structured output: the same model constrained to a regular expression (a book, a chapter and a verse)"
"$BIN/kvserve" generate --target "127.0.0.1:$PORT" --max-new-tokens 40 --temperature 0.8 --seed 7 \
  --regex '(Genesis|Exodus|Psalms|John) [1-9][0-9]?:[1-9][0-9]?' "${QUESTION:-Where is the flood told?} "

echo "== 6/6 stop the server (SIGTERM: drain, then exit 0)"
kill -TERM "$server"
wait "$server"
trap - EXIT
echo "done"
