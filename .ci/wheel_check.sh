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
ours() {  # pids of processes started from this check's venv (a unique temporary path)
    "$PYTHON" - "$WORK/venv/" <<'PY'
import os, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if sys.argv[1].encode() in f.read() and int(pid) != os.getpid():
                print(pid)
    except OSError:
        pass
PY
}
cleanup() {
    if [[ -n "$UP_PID" ]] && kill -0 "$UP_PID" 2>/dev/null; then kill -KILL "$UP_PID" || true; fi
    for pid in $(ours); do kill -KILL "$pid" 2>/dev/null || true; done
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
# python3, not curl: a clean CI machine has python3 and pip, nothing more
http() {  # http URL [JSON BODY]: print the answer's body; fail on no answer or an error status
    "$WORK/venv/bin/python" - "$@" <<'PY'
import sys, urllib.request
url, body = sys.argv[1], (sys.argv[2].encode() if len(sys.argv) > 2 else None)
req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as resp:
        sys.stdout.write(resp.read().decode())
except OSError as exc:
    sys.exit(f"{url}: {exc}")
PY
}
for _ in $(seq 1 600); do
    if http "http://127.0.0.1:$PORT/v1/models" 2>/dev/null | grep -q '"llama-7b"'; then break; fi
    kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/up.log"; echo "flexpipe up exited"; exit 1; }
    sleep 0.2
done
ANSWER=$(http "$BASE/chat/completions" \
    '{"model": "llama-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}') \
    || { cat "$WORK/up.log"; exit 1; }
echo "$ANSWER" | grep -q '"chat.completion"' || { echo "$ANSWER"; cat "$WORK/up.log"; exit 1; }
say "one chat completion through flexpipe up at $BASE"

kill -INT "$UP_PID"
for _ in $(seq 1 600); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$UP_PID" 2>/dev/null; then cat "$WORK/up.log"; echo "up did not stop"; exit 1; fi
wait "$UP_PID" || { cat "$WORK/up.log"; echo "up exited non-zero"; exit 1; }
UP_PID=""
for _ in $(seq 1 100); do [[ -z "$(ours)" ]] && break; sleep 0.1; done
LEFT=$(ours)
if [[ -n "$LEFT" ]]; then echo "processes left behind: $LEFT"; exit 1; fi
say "stopped; no process left; done"
