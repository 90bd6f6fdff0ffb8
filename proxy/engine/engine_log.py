"""Reads what an engine loaded from its log lines (vLLM, SGLang, llama.cpp's server).

Lines may carry any prefix (docker, ``kubectl logs --timestamps``, journald) and ANSI colour:
the engine's own header is searched anywhere in the line. A line it does not understand is
ignored and counted; a line longer than ``max_line_chars`` is cut before it is looked at, so
memory stays bounded however long the log grows (the facts hold a fixed set of fields, and the
warning lists are capped)."""

from __future__ import annotations

import ast
import re
from typing import Any

from proxy.engine.facts import EngineFacts
from proxy.redact import mask_secrets

MAX_LIST = 64  # unknown/deprecated/fallback entries kept at most
MAX_ITEM = 300  # characters kept of one deprecation/fallback text
MAX_DICT_REPR = 16384  # a non-default args repr longer than this is not parsed

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_VLLM = re.compile(
    r"(?:\((?P<proc>[A-Za-z_][\w]*) pid=\d+\) )?"
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
    r"\[[^\]]*\] ?(?P<msg>.*)"
)
_PYWARN = re.compile(r"(?:^|\s)\S+\.py:\d+: (?P<cat>\w*Warning): (?P<msg>.*)")
_SGLANG = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?(?: [A-Z]+\d+)*\] (?P<msg>.*)")
# vLLM messages
_BANNER_VERSION = re.compile(r"\bversion (?P<v>\d+\.\d+\.\d+\S*)\s*$")
_BANNER_MODEL = re.compile(r"\bmodel {2,}(?P<m>\S+)\s*$")
_SERVER_VERSION = re.compile(r"vLLM server version (?P<v>[^\s,]+), serving model (?P<m>\S+)")
_VLLM_API_VERSION = re.compile(r"vLLM API server version (?P<v>\S+)")
_NON_DEFAULT = re.compile(r"non-default args: (?P<d>\{.*\})\s*$")
_INIT = re.compile(r"Initializing a V1 LLM engine \(v(?P<v>[^)]+)\) with config: (?P<c>.*)")
_AUTO_ATTN = re.compile(r"Using (?P<b>\w+) attention backend out of potential backends")
_EXPLICIT_ATTN = re.compile(r"Using AttentionBackendEnum\.(?P<b>\w+) backend")
_FA_VERSION = re.compile(r"Using FlashAttention version (?P<n>\d+)")
# "Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend out of potential backends: [...]" (the choice);
# "Using TritonExperts MoE backend" (the experts class it then builds: kept only when alone)
_MOE = re.compile(r"Using '?(?P<b>[\w.-]+)'? \w+ MoE backend out of potential backends")
_MOE_CLASS = re.compile(r"Using '?(?P<b>[\w.-]+)'? MoE backend\b")
_SELECTED = re.compile(r"Selected (?P<k>\w+) for (?P<what>.*)")
_NVFP4_GEMM = re.compile(r"Using (?P<k>\w+) for NVFP4 GEMM")
_MARLIN = re.compile(r"Your GPU does not have native support for FP8 computation")
_EAGER = re.compile(
    r"Cudagraph is disabled under eager mode|Enforce eager set, disabling torch\.compile"
)
_CAPTURING = re.compile(r"Capturing CUDA graphs|Graph capturing finished")
_CHUNKED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(?P<n>\d+)")
_UNKNOWN_ENV = re.compile(r"Unknown vLLM environment variable detected: (?P<n>\w+)")
_DEPRECATED = re.compile(r"argument '[^']+' is deprecated|\bis deprecated\b")
_FORCED = re.compile(r"Tried to force \S+, but the kernel couldn't be implemented")
_FAILED = re.compile(r"EngineCore failed to start|Engine core initialization failed")
_BATCH_INV = re.compile(
    r"[Bb]atch[- ]invariant (?:mode )?(?:is )?enabled|Enabling batch[- ]invariant"
)
# vLLM 0.23 logs nothing of its own for VLLM_BATCH_INVARIANT=1; torch's override warning, in the
# engine core's output, names the module that replaced its kernels (seen on the H200,
# 2026-12-04). Its absence says nothing (a warnings filter hides it): never read as false.
_BATCH_INV_KERNEL = re.compile(r"registered at \S*vllm/model_executor/layers/batch_invariant\.py")
# SGLang messages
_SG_ATTN = re.compile(r"Use (?P<b>\w+) backend by default")
_SG_ARGS = re.compile(r"server_args=ServerArgs\((?P<a>.*)\)\s*$")
_SG_VERSION = re.compile(r"\bsglang(?:==| version:? ?v?)(?P<v>\d+\.\d+\S*)", re.IGNORECASE)
_SG_FAILED = re.compile(r"Scheduler hit an exception|Rank \d+ scheduler is dead|Exit code: -?\d+")
# llama.cpp's server
_LC_BACKEND = re.compile(r"load_backend: loaded (?P<b>\w+) backend from")
_LC_OFFLOAD = re.compile(r"offloaded (?P<n>\d+)/(?P<m>\d+) layers to GPU")
_LC_START = re.compile(r"\bllama_server: initializing\b")
_LC_BUILD = re.compile(r"\bbuild:? (?:= )?(?P<b>\d+ \([0-9a-f]+\))")
_LC_FA = re.compile(r"Flash Attention (?:was auto, set to )?(?P<v>enabled|disabled)")
_LC_NOSPEC = re.compile(r"no implementations specified for speculative decoding")
_LC_PROMPT_CACHE = re.compile(r"prompt cache is (?P<v>enabled|disabled)")
_LC_MODEL = re.compile(
    r"(?:loading model '|llama_model_loader: loaded meta data .* from )"
    r"(?P<m>[^']+?)'?(?: \(version|$)"
)
_LOGO = re.compile(r"[█▄▀]")
_LC_FTYPE = re.compile(r"print_info: file type\s*=\s*(?P<t>\S+)")
_LC_FAILED = re.compile(r"main: exiting due to model loading error|failed to load model")
_LC_KV = re.compile(r"llama_kv_cache\S*: .*?K \((?P<k>\w+)\)")
# compiled config pieces (inside the Initializing line)
_CFG = {
    "dtype": re.compile(r"\bdtype=(?:torch\.)?(?P<v>[\w]+)"),
    "quantization": re.compile(r"\bquantization=(?P<v>[\w-]+)"),
    "enforce_eager": re.compile(r"\benforce_eager=(?P<v>True|False)"),
    "kv_cache_dtype": re.compile(r"\bkv_cache_dtype=(?P<v>[\w]+)"),
    "prefix_caching": re.compile(r"\benable_prefix_caching=(?P<v>True|False)"),
    "chunked_prefill": re.compile(r"\benable_chunked_prefill=(?P<v>True|False)"),
    "compilation_mode": re.compile(r"'mode': <CompilationMode\.(?P<v>\w+)"),
    "cudagraph_mode": re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(?P<v>\w+)"),
    "moe_backend": re.compile(r"\bmoe_backend='(?P<v>[^']*)'"),
    "linear_backend": re.compile(r"\blinear_backend='(?P<v>[^']*)'"),
}
_SPEC_NONE = re.compile(r"\bspeculative_config=None\b")
_SPEC = re.compile(r"\bspeculative_config=SpeculativeConfig\((?P<s>[^)]*)\)")
_SPEC_METHOD = re.compile(r"\bmethod='?(?P<v>[\w-]+)'?")
_SPEC_MODEL = re.compile(r"\bmodel='?(?P<v>[^',)]+)'?")
_SPEC_K = re.compile(r"\bnum_spec_tokens=(?P<v>\d+)")
# What may be said before a start's banner (llama.cpp loads its backends first).
_PRELUDE = frozenset({"engine", "backends"})
_DEPRECATION_WARNINGS = ("FutureWarning", "DeprecationWarning")
_BOOL = {"True": True, "False": False, "true": True, "false": False}


def _safe_literal(text: str) -> Any:
    if len(text) > MAX_DICT_REPR:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


class EngineLogReader:
    """Feeds on an engine's log lines (vLLM, SGLang, llama.cpp's server), any prefix (docker,
    kubectl, journald timestamps) and ANSI colour allowed."""

    def __init__(self, max_line_chars: int = 65536) -> None:
        self.max_line_chars = max_line_chars
        self.read_lines = 0
        self.ignored_lines = 0
        self._values: dict[str, Any] = {}
        self._unknown: dict[str, None] = {}
        self._deprecated: dict[str, None] = {}
        self._fallbacks: dict[str, None] = {}
        self._failed = False
        self._facts = EngineFacts()

    def reset(self) -> None:
        """A new engine start: forget its facts (the line counters keep counting)."""
        self._values = {}
        self._unknown = {}
        self._deprecated = {}
        self._fallbacks = {}
        self._failed = False
        self._facts = EngineFacts()

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def feed(self, line: str) -> bool:
        """Reads one line; True when the facts changed."""
        self.read_lines += 1
        text = _ANSI.sub("", line[: self.max_line_chars]).rstrip("\r\n")
        before = self._snapshot()
        understood = self._vllm(text) or self._sglang(text) or self._llama(text)
        if not understood:
            self.ignored_lines += 1
            return False
        after = self._snapshot()
        if after == before:
            return False
        self._facts = EngineFacts(
            dict(self._values),
            {k: "log" for k in self._values},
            tuple(self._unknown),
            tuple(self._deprecated),
            tuple(self._fallbacks),
            self._failed,
        )
        return True

    # -- helpers
    def _snapshot(self) -> tuple[Any, ...]:
        return (
            tuple(self._values.items()),
            len(self._unknown),
            len(self._deprecated),
            len(self._fallbacks),
            self._failed,
        )

    def _set(self, key: str, value: Any) -> None:
        self._values[key] = value

    @staticmethod
    def _add(into: dict[str, None], item: str) -> None:
        if len(into) < MAX_LIST:
            into.setdefault(item[:MAX_ITEM], None)

    def _new_start(self, engine: str) -> None:
        """A banner: a new process; what an earlier one said is stale."""
        said = self._values.keys() - _PRELUDE
        if said or self._failed or self._unknown or self._deprecated or self._fallbacks:
            self.reset()
        self._set("engine", engine)

    # -- vLLM
    def _vllm(self, text: str) -> bool:
        m = _VLLM.search(text)
        if m is None:
            if _BATCH_INV_KERNEL.search(text) is not None:
                self._set("batch_invariant", True)
                return True
            w = _PYWARN.search(text)
            if w is None or ("VLLM_" not in w["msg"] and "vllm" not in text):
                return False
            if "deprecat" in w["msg"].lower() or w["cat"] in _DEPRECATION_WARNINGS:
                self._add(self._deprecated, w["msg"].strip())
                return True
            return False
        msg = m["msg"].strip()
        return self._vllm_start(msg) or self._vllm_choice(msg) or self._vllm_warning(msg)

    def _vllm_start(self, msg: str) -> bool:
        if (v := _BANNER_VERSION.search(msg)) is not None and _LOGO.search(msg):
            self._new_start("vllm")
            self._set("version", v["v"])
            return True
        if (v := _BANNER_MODEL.search(msg)) is not None and _LOGO.search(msg):
            self._set("engine", "vllm")
            self._set("model", v["m"])
            return True
        if (v := _SERVER_VERSION.search(msg)) is not None:
            self._new_start("vllm")
            self._set("version", v["v"])
            self._set("model", v["m"])
            return True
        if (v := _VLLM_API_VERSION.search(msg)) is not None:
            self._new_start("vllm")
            self._set("version", v["v"])
            return True
        if (v := _NON_DEFAULT.search(msg)) is not None:
            args = _safe_literal(v["d"])
            if isinstance(args, dict):
                self._set("engine", "vllm")
                # vLLM lists --api-key (and any token, password in a URL) among them
                shown = mask_secrets({str(k): a for k, a in args.items()})
                self._set("non_default_args", shown)
                return True
            return False
        if (v := _INIT.search(msg)) is not None:
            self._init_config(v["v"], v["c"])
            return True
        return False

    def _vllm_choice(self, msg: str) -> bool:
        if (v := _EXPLICIT_ATTN.search(msg)) is not None:
            self._set("attention_backend", v["b"])
            return True
        if (v := _AUTO_ATTN.search(msg)) is not None:
            self._set("attention_backend", v["b"])
            return True
        if (v := _FA_VERSION.search(msg)) is not None:
            self._set("flash_attn_version", int(v["n"]))
            return True
        if (v := _MOE.search(msg)) is not None:
            self._set("moe_backend", v["b"])
            return True
        if (v := _MOE_CLASS.search(msg)) is not None:
            self._values.setdefault("moe_backend", v["b"])
            return True
        if (v := _NVFP4_GEMM.search(msg)) is not None:
            self._set("linear_backend", v["k"])
            return True
        if (v := _SELECTED.search(msg)) is not None:
            self._set("linear_backend", v["k"])
            return True
        if _MARLIN.search(msg) is not None:
            self._add(self._fallbacks, "FP8 weight-only Marlin: " + msg)
            return True
        if _FORCED.search(msg) is not None:
            self._add(self._fallbacks, msg)
            return True
        if _EAGER.search(msg) is not None:
            self._set("enforce_eager", True)
            self._set("cudagraphs", False)
            return True
        if _CAPTURING.search(msg) is not None:
            self._set("cudagraphs", True)
            return True
        if _CHUNKED.search(msg) is not None:
            self._set("chunked_prefill", True)
            return True
        if _BATCH_INV.search(msg) is not None:
            self._set("batch_invariant", True)
            return True
        return False

    def _vllm_warning(self, msg: str) -> bool:
        if (v := _UNKNOWN_ENV.search(msg)) is not None:
            self._add(self._unknown, v["n"])
            return True
        if _FAILED.search(msg) is not None:
            self._failed = True
            return True
        if _DEPRECATED.search(msg) is not None:
            self._add(self._deprecated, msg)
            return True
        return False

    def _init_config(self, version: str, cfg: str) -> None:
        self._set("engine", "vllm")
        self._values.setdefault("version", version)
        for key, rx in _CFG.items():
            found = rx.search(cfg)
            if found is None:
                continue
            raw = found["v"]
            value: Any = _BOOL.get(raw, raw)
            if key == "quantization" and raw == "None":
                value = None
            if key in ("moe_backend", "linear_backend") and (raw == "auto" or key in self._values):
                continue  # 'auto' is what was asked; a selection line says what loaded
            self._set(key, "none" if value is None else value)
        if (
            self._values.get("enforce_eager") is True
            or self._values.get("cudagraph_mode") == "NONE"
        ):
            self._set("cudagraphs", False)
        elif "cudagraph_mode" in self._values and "cudagraphs" not in self._values:
            self._set("cudagraphs", True)
        if _SPEC_NONE.search(cfg) is not None:
            self._set("speculative", False)
        elif (s := _SPEC.search(cfg)) is not None:
            body = s["s"]
            method = _SPEC_METHOD.search(body)
            self._set("speculative", method["v"] if method else True)
            if (d := _SPEC_MODEL.search(body)) is not None:
                self._set("speculative_draft", d["v"])
            if (k := _SPEC_K.search(body)) is not None:
                self._set("num_speculative_tokens", int(k["v"]))

    # -- SGLang
    def _sglang(self, text: str) -> bool:
        m = _SGLANG.search(text)
        if m is None:
            return False
        msg = m["msg"].strip()
        if (v := _SG_ATTN.search(msg)) is not None:
            self._set("engine", "sglang")
            self._set("attention_backend", v["b"])
            return True
        if (v := _SG_ARGS.search(msg)) is not None:
            self._set("engine", "sglang")
            self._sglang_args(v["a"])
            return True
        if (v := _SG_VERSION.search(msg)) is not None:
            self._new_start("sglang")
            self._set("version", v["v"])
            return True
        if "Capture cuda graph begin" in msg or "Capture cuda graph end" in msg:
            self._set("engine", "sglang")
            self._set("cudagraphs", True)
            return True
        if _SG_FAILED.search(msg) is not None:
            self._failed = True
            return True
        if _DEPRECATED.search(msg) is not None:
            self._add(self._deprecated, msg)
            return True
        return False

    def _sglang_args(self, args: str) -> None:
        def arg(name: str) -> str | None:
            found = re.search(r"\b" + name + r"=('(?P<s>[^']*)'|(?P<r>[^,\s)]+))", args)
            if found is None:
                return None
            return found["s"] if found["s"] is not None else found["r"]

        def put(key: str, raw: str | None, invert: bool = False) -> None:
            if raw is None:
                return
            if raw in _BOOL:
                self._set(key, _BOOL[raw] is not invert)
            elif raw != "None":
                self._set(key, raw)

        put("model", arg("model_path"))
        put("dtype", arg("dtype"))
        q = arg("quantization")
        if q is not None:
            self._set("quantization", "none" if q == "None" else q)
        if (a := arg("attention_backend")) not in (None, "None"):
            self._set("attention_backend", a)
        if (a := arg("moe_runner_backend")) not in (None, "None"):
            self._set("moe_backend", a)
        put("cudagraphs", arg("disable_cuda_graph"), invert=True)
        put("prefix_caching", arg("disable_radix_cache"), invert=True)
        put("batch_invariant", arg("enable_deterministic_inference"))
        spec = arg("speculative_algorithm")
        if spec is not None:
            self._set("speculative", False if spec == "None" else spec)
        put("speculative_draft", arg("speculative_draft_model_path"))
        put("kv_cache_dtype", arg("kv_cache_dtype"))
        chunk = arg("chunked_prefill_size")
        if chunk not in (None, "None"):
            assert chunk is not None
            self._set("chunked_prefill", chunk.lstrip("-").isdigit() and int(chunk) > 0)

    # -- llama.cpp's server
    def _llama(self, text: str) -> bool:
        if _LC_START.search(text) is not None:
            self._new_start("llama.cpp")
            return True
        if (v := _LC_BUILD.search(text)) is not None:
            if "version" in self._values:
                self._new_start("llama.cpp")
            self._set("engine", "llama.cpp")
            self._set("version", v["b"])
            return True
        if (v := _LC_FA.search(text)) is not None:
            self._set("attention_backend", "flash_attn" if v["v"] == "enabled" else "no_flash_attn")
            return True
        if _LC_NOSPEC.search(text) is not None:
            self._set("speculative", False)
            return True
        if (v := _LC_PROMPT_CACHE.search(text)) is not None:
            self._set("prefix_caching", v["v"] == "enabled")
            return True
        if (v := _LC_KV.search(text)) is not None:
            self._set("kv_cache_dtype", v["k"])
            return True
        if (v := _LC_BACKEND.search(text)) is not None:
            self._set("engine", "llama.cpp")
            backends = self._values.get("backends", ())
            self._set("backends", tuple(dict.fromkeys((*backends, v["b"]))))
            return True
        if (v := _LC_OFFLOAD.search(text)) is not None:
            self._set("engine", "llama.cpp")
            self._set("gpu_layers", f"{v['n']}/{v['m']}")
            return True
        if (v := _LC_MODEL.search(text)) is not None:
            self._set("engine", "llama.cpp")
            self._set("model", v["m"].strip())
            return True
        if (v := _LC_FTYPE.search(text)) is not None:
            self._set("quantization", v["t"])
            return True
        if _LC_FAILED.search(text) is not None:
            self._failed = True
            return True
        return False
