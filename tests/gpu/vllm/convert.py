"""GGUF -> bf16 safetensors checkpoint that vLLM serves (runs where torch and transformers are).

vLLM 0.23's GGUF path gives NaN logprobs for this model (../../../../shared/reference/
vllm-on-h200.md), so the audit runs on a bf16 checkpoint made from the same GGUF:
transformers dequantizes it (``gguf`` on the path), the state dict is written with
safetensors (``save_pretrained`` refuses GGUF-loaded models), ``lm_head`` left out when it is
the tied embedding, and the tokenizer saved beside it with ``<|im_end|>`` as its end token
(the one built from the GGUF ends on ``<|im_start|>``). Then a greedy answer from the saved
checkpoint, as a check.

    python3 convert.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

END = "<|im_end|>"


def main() -> None:
    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    print("tokenizer from GGUF: eos", repr(tok.eos_token), "bos", repr(tok.bos_token))
    if tok.eos_token != END:
        tok.eos_token = END
    if tok.pad_token is None:
        tok.pad_token = END
    tok.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    state = model.state_dict()
    tied = "lm_head.weight" in state and torch.equal(
        state["lm_head.weight"], state["model.embed_tokens.weight"]
    )
    tensors = {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in state.items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    cfg.pop("quantization_config", None)
    cfg |= {
        "architectures": ["LlamaForCausalLM"],
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "eos_token_id": tok.convert_tokens_to_ids(END),
        "bos_token_id": tok.convert_tokens_to_ids("<|im_start|>"),
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    print(
        f"wrote {len(tensors)} tensors (lm_head tied: {tied}), model_type {cfg.get('model_type')},"
        f" {time.monotonic() - t0:.1f} s"
    )
    del model
    try:
        check = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to("cuda")
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"].to("cuda")
        with torch.no_grad():
            gen = check.generate(ids, max_new_tokens=16, do_sample=False)
        print("check (transformers, greedy):", repr(tok.decode(gen[0, ids.shape[1] :])))
    except Exception as exc:  # the check only informs; vLLM is the real test
        print("check failed:", type(exc).__name__, exc)


if __name__ == "__main__":
    main()
