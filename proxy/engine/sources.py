"""What the engine's own endpoints say it loaded: vLLM's ``/server_info`` (dev mode) and
``vllm:cache_config_info``, SGLang's ``/server_info``, llama.cpp's ``/props``.

Pure functions of what was fetched; any junk input gives ``EngineFacts()`` (or the facts it
could read), never an exception."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from proxy.engine.engine_log import EngineLogReader
from proxy.engine.facts import EngineFacts

MAX_TEXT = 1 << 20  # characters of a text payload looked at
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(?P<k>\w+)="(?P<v>(?:[^"\\]|\\.)*)"')
_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
_COMPILATION_MODES = {
    0: "NONE",
    1: "STOCK_TORCH_COMPILE",
    2: "DYNAMO_TRACE_ONCE",
    3: "VLLM_COMPILE",
}
_CUDAGRAPH_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL"}
_INIT_HEADER = (
    "INFO 01-01 00:00:00 [core.py:1] Initializing a V1 LLM engine (vunknown) with config: "
)
# VLLM_* variables that decide the recipe; in vllm_env when the build knows them.
_VLLM_ENV_FACTS = {"VLLM_BATCH_INVARIANT": "batch_invariant"}


def _facts(values: Mapping[str, Any], source: str) -> EngineFacts:
    """The known values; nothing but the engine's name is nothing said."""
    known = {k: v for k, v in values.items() if v is not None}
    if known.keys() <= {"engine"}:
        return EngineFacts()
    return EngineFacts(known, {k: source for k in known})


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return _BOOLS.get(value.strip().lower())
    return None


def _str(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        text = value.strip()
        return text[len("torch.") :] if text.startswith("torch.") else text
    return None


def _enum_name(value: Any, numbers: Mapping[int, str]) -> str | None:
    """``<CUDAGraphMode.NONE: 0>``, ``CUDAGraphMode.NONE``, ``"NONE"`` or 0 -> a name."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return numbers.get(value)
    if isinstance(value, str):
        m = re.search(r"(?:\w+\.)?(?P<n>[A-Z][A-Z0-9_]*)", value)
        return m["n"] if m else None
    return None


def facts_from_vllm_server_info(info: Any) -> EngineFacts:
    """``/server_info?config_format=json``: ``vllm_config`` as a dict (or the older text form,
    read like the log's ``Initializing ... with config:`` line), ``vllm_env``."""
    try:
        return _vllm_server_info(info)
    except Exception:  # junk in, nothing out
        return EngineFacts()


def _vllm_server_info(info: Any) -> EngineFacts:
    if not isinstance(info, Mapping):
        return EngineFacts()
    cfg = info.get("vllm_config")
    out = EngineFacts()
    if isinstance(cfg, str):
        reader = EngineLogReader()
        text = cfg[:MAX_TEXT]
        if "Initializing a V1" not in text:
            text = _INIT_HEADER + text
        reader.feed(text)
        said = {k: v for k, v in reader.facts.values.items() if k != "version" or v != "unknown"}
        out = _facts(said, "server_info")
    elif isinstance(cfg, Mapping):
        out = _facts(_vllm_config(cfg), "server_info")
    return _with_env(out, info)


def _vllm_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    model = _get(cfg, "model_config")
    cache = _get(cfg, "cache_config")
    sched = _get(cfg, "scheduler_config")
    comp = _get(cfg, "compilation_config")
    spec = _get(cfg, "speculative_config")
    kernel = _get(cfg, "kernel_config")
    quant = _get(model, "quantization")
    values: dict[str, Any] = {
        "engine": "vllm",
        "model": _str(_get(model, "model")),
        "dtype": _str(_get(model, "dtype")),
        "quantization": "none"
        if isinstance(model, Mapping) and "quantization" in model and quant is None
        else _str(quant),
        "enforce_eager": _bool(_get(model, "enforce_eager")),
        "kv_cache_dtype": _str(_get(cache, "cache_dtype")),
        "prefix_caching": _bool(_get(cache, "enable_prefix_caching")),
        "chunked_prefill": _bool(_get(sched, "enable_chunked_prefill")),
        "compilation_mode": _enum_name(_get(comp, "mode"), _COMPILATION_MODES),
        "cudagraph_mode": _enum_name(_get(comp, "cudagraph_mode"), _CUDAGRAPH_MODES),
        "attention_backend": _str(_get(cfg, "attention_config", "backend")),
    }
    for key in ("moe_backend", "linear_backend"):
        chosen = _str(_get(kernel, key))
        if chosen is not None and chosen != "auto":
            values[key] = chosen
    if "speculative_config" in cfg:
        if spec is None:
            values["speculative"] = False
        elif isinstance(spec, Mapping):
            values["speculative"] = _str(spec.get("method")) or True
            values["speculative_draft"] = _str(_get(spec, "model")) or _str(
                _get(spec, "draft_model_config", "model")
            )
            k = spec.get("num_speculative_tokens")
            values["num_speculative_tokens"] = k if isinstance(k, int) else None
    if values["enforce_eager"] is True or values["cudagraph_mode"] == "NONE":
        values["cudagraphs"] = False
    elif values["cudagraph_mode"] is not None:
        values["cudagraphs"] = True
    return values


def _said_none(obj: Any, key: str) -> bool:
    return isinstance(obj, Mapping) and key in obj and obj[key] is None


def _with_env(out: EngineFacts, info: Mapping[str, Any]) -> EngineFacts:
    env = info.get("vllm_env")
    if isinstance(env, Mapping):
        extra: dict[str, Any] = {}
        for var, key in _VLLM_ENV_FACTS.items():
            if var in env:
                extra[key] = _bool(env[var])
        out = out.merged(_facts(extra, "server_info"))
        declared = info.get("declared_env")  # the operator's VLLM_* names, when the caller knows
        if isinstance(declared, (list, tuple)):
            unknown = tuple(v for v in declared if isinstance(v, str) and v not in env)
            out = out.merged(EngineFacts(unknown_env=unknown))
    return out


def facts_from_cache_config_info(metrics_text: str) -> EngineFacts:
    """``vllm:cache_config_info``'s labels: enable_prefix_caching, cache_dtype."""
    if not isinstance(metrics_text, str):
        return EngineFacts()
    m = _CACHE_INFO.search(metrics_text[:MAX_TEXT])
    if m is None:
        return EngineFacts()
    labels = {x["k"]: x["v"] for x in _LABEL.finditer(m["labels"])}
    return _facts(
        {
            "engine": "vllm",
            "prefix_caching": _bool(labels.get("enable_prefix_caching")),
            "kv_cache_dtype": _str(labels.get("cache_dtype")),
        },
        "cache_config_info",
    )


def facts_from_sglang_server_info(info: Any) -> EngineFacts:
    """SGLang's ``/server_info`` (or ``/get_server_info``): its server arguments."""
    if not isinstance(info, Mapping):
        return EngineFacts()
    try:
        spec = info.get("speculative_algorithm")
        chunk = info.get("chunked_prefill_size")
        no_graph = _bool(info.get("disable_cuda_graph"))
        no_radix = _bool(info.get("disable_radix_cache"))
        quant = info.get("quantization")
        values: dict[str, Any] = {
            "engine": "sglang",
            "version": _str(info.get("version")),
            "model": _str(info.get("model_path")),
            "dtype": _str(info.get("dtype")),
            "quantization": "none" if _said_none(info, "quantization") else _str(quant),
            "attention_backend": _str(info.get("attention_backend")),
            "moe_backend": _str(info.get("moe_runner_backend")),
            "batch_invariant": _bool(info.get("enable_deterministic_inference")),
            "cudagraphs": None if no_graph is None else not no_graph,
            "prefix_caching": None if no_radix is None else not no_radix,
            "chunked_prefill": (
                chunk > 0 if isinstance(chunk, int) and not isinstance(chunk, bool) else None
            ),
            "speculative": False if _said_none(info, "speculative_algorithm") else _str(spec),
            "speculative_draft": _str(info.get("speculative_draft_model_path")),
            "kv_cache_dtype": _str(info.get("kv_cache_dtype")),
        }
        k = info.get("speculative_num_draft_tokens")
        if isinstance(k, int) and not isinstance(k, bool) and values["speculative"]:
            values["num_speculative_tokens"] = k
        if values["attention_backend"] == "None":
            values["attention_backend"] = None
        return _facts(values, "sglang_server_info")
    except Exception:
        return EngineFacts()


def facts_from_llama_props(props: Any) -> EngineFacts:
    """llama.cpp's ``/props``: build_info, model_path, n_ctx, speculative settings."""
    if not isinstance(props, Mapping):
        return EngineFacts()
    try:
        settings = props.get("default_generation_settings")
        params = _get(settings, "params")
        values: dict[str, Any] = {
            "engine": "llama.cpp",
            "version": _str(props.get("build_info")),
            "model": _str(props.get("model_path")),
        }
        n_max = _get(params, "speculative.n_max")
        types = _get(params, "speculative.type") or _get(params, "speculative.types")
        if isinstance(types, str):
            values["speculative"] = False if types in ("", "none") else types
        elif isinstance(types, list):
            named = [t for t in types if isinstance(t, str) and t != "none"]
            values["speculative"] = ",".join(named) if named else False
        if values.get("speculative") and isinstance(n_max, int) and not isinstance(n_max, bool):
            values["num_speculative_tokens"] = n_max
        cache_prompt = _bool(_get(params, "cache_prompt"))
        values["prefix_caching"] = cache_prompt
        return _facts(values, "props")
    except Exception:
        return EngineFacts()
