#!/usr/bin/env bash
# tests/gpu/vllm/rendered_check.py on the lent H200, after the parts were received as in
# README.md (calls 1-8, on_device.sh receive), or after on_device.sh setup (then only the
# dropping instance starts: about a minute), in two calls:
#   bash tests/gpu/vllm/rendered_on_device.sh setup   # install, patch, convert; vLLM x2 (think)
#   bash tests/gpu/vllm/rendered_on_device.sh check   # results in $OUT/rendered.json
set -uo pipefail
cd "$(dirname "$0")/../../.."
repo=$PWD
P=/root/payload S=/root/site M=/root/model W=/root/work T=/root/model-think
mkdir -p "$P" "$W"
export PYTHONPATH="$S:$repo" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  VLLM_HOST_IP=127.0.0.1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
start() {  # as on_device.sh's: name port template
  local name=$1 port=$2 template=$3
  ( cd "$W" && setsid bash -c 'echo $$ > "$0"; exec "$@"' "$W/vllm-$name.pid" \
      python3 -m vllm.entrypoints.openai.api_server \
      --served-model-name smollm2 --max-model-len 4096 --host 127.0.0.1 --port "$port" \
      --gpu-memory-utilization 0.15 --kv-cache-memory-bytes 4294967296 \
      --model "$T" --tokenizer "$T" --dtype bfloat16 --enforce-eager \
      --reasoning-parser deepseek_r1 --chat-template "$template" \
      > "$W/vllm-$name.log" 2>&1 < /dev/null & )
}
case "${1:-}" in
setup)
  t0=$(date +%s)
  if [ ! -d "$S/vllm" ] || [ ! -f "$T/tokenizer.json" ]; then  # on_device.sh setup did not run
    got=$(cat "$P"/part-? | sha256sum | cut -d' ' -f1)
    [ "$got" = "$(cat "$P/payload.sha256")" ] || { echo "payload sha256 mismatch: $got"; exit 1; }
    cat "$P"/part-? | tar -x -C "$P" && rm -f "$P"/part-? || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S" \
      "$P"/wheels/*.whl "$P"/vllm/*.whl > "$W/pip.log" 2>&1 || { tail -20 "$W/pip.log"; exit 1; }
    python3 tests/gpu/vllm/patch_vllm.py "$S/vllm" || exit 1
    python3 tests/gpu/vllm/convert.py "$P/model/model.gguf" "$M" 2>&1 | grep -v Warning | tail -4
    python3 tests/gpu/vllm/think_tokenizer.py "$M" "$T" 2>&1 | grep -v Warning | tail -2
    echo "installed and converted in $(( $(date +%s) - t0 )) s"
  fi
  # on_device.sh's think instance (:8006) is the keeping one where it runs already.
  curl -sf http://127.0.0.1:8006/health >/dev/null || start keep 8006 "$repo/tests/integration/think.jinja"
  start drop 8007 "$repo/tests/gpu/vllm/think_drop.jinja"
  for i in $(seq 1 240); do
    curl -sf http://127.0.0.1:8006/health >/dev/null && curl -sf http://127.0.0.1:8007/health >/dev/null \
      && { echo "both up after $(( $(date +%s) - t0 )) s"; break; }
    sleep 1
  done
  for f in "$W"/vllm-keep.log "$W"/vllm-drop.log; do [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f"; }; done
  ;;
check)
  python3 tests/gpu/vllm/rendered_check.py --keep http://127.0.0.1:8006 \
    --drop http://127.0.0.1:8007 --out "${OUT:-$W/out}"
  cp "$W"/vllm-*.log "${OUT:-$W/out}/" 2>/dev/null; true
  ;;
*) echo "usage: $0 setup|check" >&2; exit 2 ;;
esac
