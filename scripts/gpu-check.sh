#!/usr/bin/env bash
# On a GPU machine with vLLM installed: start vLLM with FLy through `fly serve --engine vllm`, then run the
# server tests' client checks against it (OpenAI client, ChatOpenAI, OpenAILike, FlyChatModel(base_url)).
#   bash scripts/gpu-check.sh [TARGET] [DRAFT]        (defaults: Qwen2.5 7B / 0.5B instruct)
set -euo pipefail
TARGET=${1:-Qwen/Qwen2.5-7B-Instruct}
DRAFT=${2:-Qwen/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-8011}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
pip install -q vllm -e ".[server,dev]" 2>&1 | tail -2
fly serve --engine vllm --target "$TARGET" --draft "$DRAFT" --mode fly --port "$PORT" --api-key gpu-check \
  > "$OUT/vllm.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 5; done
FLY_SERVER_URL="http://127.0.0.1:$PORT/v1" FLY_SERVER_KEY=gpu-check FLY_SERVER_MODEL="$TARGET" \
  python -m pytest -q tests/integration/test_server.py -k "openai or chat_openai or openai_like or base_url" \
  2>&1 | tee "$OUT/tests.txt"
python scripts/load_test.py --url "http://127.0.0.1:$PORT/v1" --key gpu-check --clients 16 --requests 200 \
  | tee "$OUT/load.json"
