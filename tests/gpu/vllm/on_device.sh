#!/usr/bin/env bash
# Runs on the lent H200 machine (see README.md for the call sequence). Everything it makes
# lives outside the repository copy (a path not carried by the next call is removed there):
#   /root/payload  the parts as they arrive      /root/site   the installed wheels
#   /root/model    bf16 checkpoint + tokenizer   /root/work   logs, state, results
#   /root/model-think  the same with <think> and </think> as tokens (think_tokenizer.py)
#   bash tests/gpu/vllm/on_device.sh receive        # moves the carried .gpu/vllm/* away
#   bash tests/gpu/vllm/on_device.sh setup          # install, patch, convert, start vLLM x6
#   bash tests/gpu/vllm/on_device.sh validate ARGS  # tests/gpu/vllm/validate.py; results in $OUT
#   bash tests/gpu/vllm/on_device.sh setup-loops    # issue 49: the stock instance alone
#   bash tests/gpu/vllm/on_device.sh loops ARGS     # issue 49's loops49 steps against it
#   bash tests/gpu/vllm/on_device.sh setup-both     # issues 48 and 49 side by side (loops :8009)
set -uo pipefail
cd "$(dirname "$0")/../../.."
repo=$PWD
P=/root/payload S=/root/site M=/root/model W=/root/work T=/root/model-think
mkdir -p "$P" "$W"
export PYTHONPATH="$S:$repo" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  VLLM_HOST_IP=127.0.0.1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# name port extra-env extra-args...: one vLLM OpenAI server, in its own session so it outlives
# the call that starts it. --kv-cache-memory-bytes fixes the KV cache, so the five instances
# can start at once without one's memory profiling counting another's allocations. All but
# "graphs" run --enforce-eager (as the reference bring-up did); "graphs" runs vLLM's production
# default (torch.compile and CUDA graphs).
# The server writes its own pid file ($$ of the shell it then execs into): setsid forks when
# started as a group leader (a job of a shell with job control), so $! would be the pid of a
# parent gone at once (2026-12-01: every instance then looked dead to the validation).
start() {
  local name=$1 port=$2 envs=$3; shift 3
  ( cd "$W" && setsid bash -c 'echo $$ > "$0"; exec "$@"' "$W/vllm-$name.pid" \
      env $envs python3 -m vllm.entrypoints.openai.api_server \
      --served-model-name smollm2 --max-model-len "${MML:-4096}" --host 127.0.0.1 --port "$port" \
      --max-logprobs 20 --gpu-memory-utilization 0.15 \
      --kv-cache-memory-bytes 4294967296 "$@" > "$W/vllm-$name.log" 2>&1 < /dev/null & )
}
case "${1:-}" in
receive)
  shopt -s nullglob
  for f in .gpu/vllm/part-* .gpu/vllm/payload.sha256; do [ -e "$f" ] && mv "$f" "$P/"; done
  ls -l "$P"; df -h /root | tail -1
  ;;
info)
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  python3 -c 'import sys, torch, transformers, numba, typing_extensions as t; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(), transformers.__version__, numba.__version__)'
  python3 -m pip list 2>/dev/null | grep -iE '^(typing.extensions|aiohttp|uvloop|xxhash|prometheus.client|numpy|safetensors|anyio|httpx|idna|h11|click) ' | tr -s ' ' | tr '\n' ';'; echo
  nproc; free -g | head -2
  ;;
setup|setup-causes|setup-loops|setup-both)
  t0=$(date +%s)
  (cd "$P" && ls part-* >/dev/null) || { echo "no parts in $P"; exit 1; }
  got=$(cat "$P"/part-? | sha256sum | cut -d' ' -f1)
  [ "$got" = "$(cat "$P/payload.sha256")" ] || { echo "payload sha256 mismatch: $got"; exit 1; }
  cat "$P"/part-? | tar -x -C "$P" || exit 1
  echo "payload verified and unpacked in $(( $(date +%s) - t0 )) s"
  rm -f "$P"/part-?
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S" \
    "$P"/wheels/*.whl "$P"/vllm/*.whl > "$W/pip.log" 2>&1 || { tail -20 "$W/pip.log"; exit 1; }
  echo "installed in $(( $(date +%s) - t0 )) s"
  python3 tests/gpu/vllm/patch_vllm.py "$S/vllm" || exit 1
  python3 tests/gpu/vllm/convert.py "$P/model/model.gguf" "$M" 2>&1 | grep -v Warning | tail -12
  [ -f "$M/model.safetensors" ] || { echo "conversion failed"; exit 1; }
  echo "converted in $(( $(date +%s) - t0 )) s"
  bf16=(--model "$M" --tokenizer "$M" --dtype bfloat16)
  if [ "$1" = setup-causes ] || [ "$1" = setup-both ]; then
    # Issue 48: stock and batch-invariant, each also with --enable-prompt-tokens-details
    # (each answer then reports its cached prompt tokens).
    start stock 8001 "X=1" "${bf16[@]}" --enforce-eager
    start bi 8002 "VLLM_BATCH_INVARIANT=1" "${bf16[@]}" --enforce-eager
    start stock_ptd 8007 "X=1" "${bf16[@]}" --enforce-eager --enable-prompt-tokens-details
    start bi_ptd 8008 "VLLM_BATCH_INVARIANT=1" "${bf16[@]}" --enforce-eager \
      --enable-prompt-tokens-details
    left='{"stock": 8001, "bi": 8002, "stock_ptd": 8007, "bi_ptd": 8008}'
    if [ "$1" = setup-both ]; then
      # issue 49's instance beside them (CUDA graphs, the checkpoint's length): `loops` with
      # LOOPS_PORT=8009 while `causes` runs (separate servers: no shared batch)
      MML=$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); print(min(8192, c.get("max_position_embeddings") or 4096))' "$M/config.json")
      MML=$MML start loops 8009 "X=1" "${bf16[@]}"
      left='{"stock": 8001, "bi": 8002, "stock_ptd": 8007, "bi_ptd": 8008, "loops": 8009}'
    fi
  elif [ "$1" = setup-loops ]; then
    # Issue 49: the stock instance alone, long enough for 4096 new tokens after a prompt (the
    # checkpoint's own length if shorter); LOOPS_GRAPHS=1: CUDA graphs and torch.compile
    # (about 5x faster a token than eager, a slower start) instead of --enforce-eager.
    MML=$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); print(min(8192, c.get("max_position_embeddings") or 4096))' "$M/config.json")
    eager=(--enforce-eager); [ "${LOOPS_GRAPHS:-0}" = 1 ] && eager=()
    MML=$MML start stock 8001 "X=1" "${bf16[@]}" ${eager[@]+"${eager[@]}"}
    echo "stock :8001 starting, --max-model-len $MML, ${eager[*]:-CUDA graphs}"
    left='{"stock": 8001}'
  else
  start stock 8001 "X=1" "${bf16[@]}" --enforce-eager
  start bi 8002 "VLLM_BATCH_INVARIANT=1" "${bf16[@]}" --enforce-eager
  start spec 8003 "X=1" "${bf16[@]}" --enforce-eager --speculative-config \
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
  start gguf 8004 "VLLM_ATTENTION_BACKEND=FLASHINFER" --model "$P/model/model.gguf" --tokenizer "$M" --enforce-eager
  start graphs 8005 "X=1" "${bf16[@]}"
  # A stand-in reasoning model: vLLM's deepseek_r1 parser, a template that opens <think>.
  python3 tests/gpu/vllm/think_tokenizer.py "$M" "$T" 2>&1 | grep -v Warning | tail -4 &&
    start think 8006 "X=1" --model "$T" --tokenizer "$T" --dtype bfloat16 --enforce-eager \
      --reasoning-parser deepseek_r1 --chat-template "$repo/tests/integration/think.jinja"
  echo "6 vLLM instances starting ($(( $(date +%s) - t0 )) s): stock :8001, batch-invariant :8002, ngram :8003, gguf :8004, graphs (CUDA graphs, torch.compile) :8005, think (deepseek_r1 parser) :8006"
  # graphs compiles for a while: the validation waits for it in its own step
  left='{"stock": 8001, "bi": 8002, "spec": 8003, "gguf": 8004, "think": 8006}'
  fi
  python3 - "$W" "$left" <<'PY'
import json, os, sys, time, urllib.request
work = sys.argv[1]
t0 = time.time()
left = json.loads(sys.argv[2])
while left and time.time() - t0 < 150:
    for name, port in list(left.items()):
        try:
            pid = int(open(f"{work}/vllm-{name}.pid").read())
        except (OSError, ValueError):  # not written yet
            continue
        try:
            os.kill(pid, 0)
        except OSError:  # died: say why at once, so the next call can fix it
            print(f"{name} DIED; its log ends:", flush=True)
            print("".join(open(f"{work}/vllm-{name}.log").readlines()[-8:]), flush=True)
            del left[name]
            continue
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            print(f"{name} up after {time.time() - t0:.0f} s", flush=True)
            del left[name]
        except Exception:
            pass
    time.sleep(1)
print("not yet up:", sorted(left))
PY
  for f in "$W"/vllm-*.log; do echo "== $f"; tail -n 3 "$f"; done
  ;;
validate)
  shift
  python3 tests/gpu/vllm/validate.py --work "$W/results" --out "${OUT:-$W/out}" \
    --stock http://127.0.0.1:8001 --bi http://127.0.0.1:8002 --spec http://127.0.0.1:8003 \
    --gguf http://127.0.0.1:8004 --graphs http://127.0.0.1:8005 --think http://127.0.0.1:8006 \
    --logs "$W" "$@"
  ;;
causes)  # after setup-causes: issue 48's step alone (spec and gguf are not running)
  shift
  # its own results and $OUT/causes: `loops` may run beside it (setup-both)
  python3 tests/gpu/vllm/validate.py --work "$W/results-causes" --out "${OUT:-$W/out}/causes" \
    --stock http://127.0.0.1:8001 --bi http://127.0.0.1:8002 --spec http://127.0.0.1:9 \
    --gguf http://127.0.0.1:9 --stock-ptd http://127.0.0.1:8007 --bi-ptd http://127.0.0.1:8008 \
    --logs "$W" --steps causes "$@"
  ;;
loops)  # after setup-loops: issue 49's loops49 steps (only the stock instance is running);
  # always --resume: the screen's prompts and a one-at-a-time part's progress carry over calls
  shift
  # a later session's fresh machine goes on from an earlier one's results.json, carried as
  # .gpu/vllm/results.json (the screen's prompts and direct answers, the parts done)
  if [ -f .gpu/vllm/results.json ] && [ ! -f "$W/results/results.json" ]; then
    mkdir -p "$W/results" && mv .gpu/vllm/results.json "$W/results/results.json"
  fi
  python3 tests/gpu/vllm/validate.py --work "$W/results" --out "${OUT:-$W/out}" \
    --stock "http://127.0.0.1:${LOOPS_PORT:-8001}" --bi http://127.0.0.1:9 --spec http://127.0.0.1:9 \
    --gguf http://127.0.0.1:9 --logs "$W" --resume --steps "${L49_STEPS:-loops49*}" "$@"
  ;;
*) echo "usage: $0 receive|info|setup|setup-causes|setup-loops|setup-both|validate|causes|loops" >&2; exit 2 ;;
esac
