"""The two source patches vLLM 0.23.0 needs where optional backends are absent.

``get_quantization_config`` imports every quantization backend before it looks at the one
asked for (one needs the absent ``humming``): for ``gguf`` it now returns ``GGUFConfig`` first.
``flashinfer_sampler_supported`` imports flashinfer (absent): it now returns False on
ImportError. Idempotent; exits 1 when a patch site is not found.
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "# detproxy-gpu-patch"


def patch(path: Path, old: str, new: str) -> str:
    text = path.read_text()
    if MARK in text:
        return "already patched"
    if text.count(old) != 1:
        raise SystemExit(f"patch site not found in {path}")
    path.write_text(text.replace(old, new))
    return "patched"


def main() -> None:
    root = Path(sys.argv[1])
    quant = root / "model_executor/layers/quantization/__init__.py"
    old = '        raise ValueError(f"Invalid quantization method: {quantization}")\n'
    new = old + (
        f'    if quantization == "gguf":  {MARK}\n'
        "        from .gguf import GGUFConfig\n\n"
        "        return GGUFConfig\n"
    )
    print("quantization:", patch(quant, old, new))
    sampler = root / "v1/sample/ops/topk_topp_sampler.py"
    old = "    from vllm.v1.attention.backends.flashinfer import FlashInferBackend\n"
    new = (
        f"    try:  {MARK}\n"
        "        from vllm.v1.attention.backends.flashinfer import FlashInferBackend\n"
        "    except ImportError:\n"
        "        return False\n"
    )
    print("sampler:", patch(sampler, old, new))


if __name__ == "__main__":
    main()
