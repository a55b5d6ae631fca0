#!/usr/bin/env bash
# The wheel, anywhere: build it, install it into a clean virtual environment outside the
# checkout, and from a folder that is not the checkout run `flexpipe --version`,
# `flexpipe up --dry-run` and one real chat completion through `flexpipe up` (sim engines);
# then stop `up` and check that no process it started is left.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
START_S=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/flexpipe-wheel.XXXXXX")
UP_PID=""
cleanup() {
    if [[ -n "$UP_PID" ]] && kill -0 "$UP_PID" 2>/dev/null; then kill -KILL "$UP_PID" || true; fi
    # processes of this check's own venv (a unique temporary path), by id
    for pid in $(pgrep -f "$WORK/venv/" || true); do kill -KILL "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "wheel_check [$((SECONDS - START_S)) s]: $*"; }

"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" .
WHEEL=$(ls "$WORK"/dist/flexpipe-*.whl)
say "built $(basename "$WHEEL")"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --no-compile "$WHEEL"
say "installed into a clean venv"

mkdir "$WORK/elsewhere" && cd "$WORK/elsewhere"
FP="$WORK/venv/bin/flexpipe"
"$FP" --version
STORE="sqlite:///$WORK/fp.db"
"$FP" up --dry-run --store "$STORE" > "$WORK/dry-run.txt"
grep -q "fragmented-4gpu" "$WORK/dry-run.txt" || { cat "$WORK/dry-run.txt"; exit 1; }
say "up --dry-run planned the built-in example"

PORT=$("$WORK/venv/bin/python" -c 'from flexpipe.launch import free_port; print(free_port())')
CPORT=$("$WORK/venv/bin/python" -c 'from flexpipe.launch import free_port; print(free_port())')
"$FP" up --port "$PORT" --controller-port "$CPORT" --time-scale 0.02 --store "$STORE" \
    > "$WORK/up.log" 2>&1 &
UP_PID=$!
BASE="http://127.0.0.1:$PORT/v1"
for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
    kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/up.log"; echo "flexpipe up exited"; exit 1; }
    sleep 0.2
done
curl -sf "$BASE/models" | grep -q '"llama-7b"' || { cat "$WORK/up.log"; exit 1; }
ANSWER=$(curl -sf "$BASE/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "llama-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}')
echo "$ANSWER" | grep -q '"chat.completion"' || { echo "$ANSWER"; cat "$WORK/up.log"; exit 1; }
say "one chat completion through flexpipe up at $BASE"

kill -INT "$UP_PID"
for _ in $(seq 1 600); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$UP_PID" 2>/dev/null; then cat "$WORK/up.log"; echo "up did not stop"; exit 1; fi
wait "$UP_PID" || { cat "$WORK/up.log"; echo "up exited non-zero"; exit 1; }
UP_PID=""
for _ in $(seq 1 100); do pgrep -f "$WORK/venv/" > /dev/null || break; sleep 0.1; done
if pgrep -af "$WORK/venv/"; then echo "processes left behind (above)"; exit 1; fi
say "stopped; no process left; done"
