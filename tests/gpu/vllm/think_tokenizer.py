"""A thinking variant of the converted checkpoint: ``<think>`` and ``</think>`` as tokens.

vLLM's reasoning parsers (``deepseek_r1``, ``qwen3``) find the markers as single tokens of the
vocabulary, and SmolLM2 has none. Two of its unused control tokens (StarCoder's
``<gh_stars>`` and ``<issue_start>``, ids 7 and 8) are renamed ``<think>`` and ``</think>`` in
a copy of the tokenizer; the weights are linked, not copied. Served with
``tests/integration/think.jinja`` (the generation prompt opens ``<think>``), SmolLM2 writes
reasoning that it never closes itself: a stand-in for a reasoning model whose reasoning loops.
Then a check that the markers tokenise to those ids.

    python3 think_tokenizer.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RENAMED = {"<gh_stars>": "<think>", "<issue_start>": "</think>"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def renamed(value: Any) -> Any:
    """``value`` with the renamed tokens' names replaced, anywhere in it."""
    if isinstance(value, str):
        return RENAMED.get(value, value)
    if isinstance(value, list):
        return [renamed(v) for v in value]
    if isinstance(value, dict):
        out = {renamed(k): renamed(v) for k, v in value.items()}
        if out.get("content") in RENAMED.values():
            out["special"] = False  # kept in the detokenised text, as real models' markers are
        return out
    return value


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        target = out / path.name
        if path.name in TOKENIZER_FILES:
            data = json.loads(path.read_text())
            if path.name == "tokenizer.json":
                # The BPE merges are pairs of strings: none of them is a control token.
                merges = data["model"].pop("merges", None)
                data = renamed(data)
                if merges is not None:
                    data["model"]["merges"] = merges
            else:
                data = renamed(data)
            target.write_text(json.dumps(data, ensure_ascii=False))
        elif not target.exists():
            target.symlink_to(path.resolve())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("<think>\nhm\n</think>\n\nok", add_special_tokens=False)["input_ids"]
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    print(f"think variant: <think> {think}, </think> {end}, sample ids {ids}")
    print(f"  decoded {tok.decode(ids)!r}")
    if think not in ids or end not in ids:
        raise SystemExit("the markers do not tokenise as single tokens")


if __name__ == "__main__":
    main()
