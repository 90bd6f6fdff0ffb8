"""What a request is: its endpoint, model, stream flag, and whether it is deterministic.

Pure functions over the parsed body. Fields of the wrong type never raise: the request is
then simply not deterministic (it is forwarded unaudited and the upstream decides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM treats temperature below this as greedy (SamplingType.GREEDY).
GREEDY_EPSILON = 1e-5

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass(frozen=True, slots=True)
class RequestView:
    endpoint: str  # chat | completions
    model: str  # "" when absent or not a string
    stream: bool
    deterministic: bool
    well_typed: bool  # every field detproxy reads has the type the API documents

    def __init__(
        self, endpoint: str, model: str, stream: bool, deterministic: bool, well_typed: bool
    ) -> None:
        # Written out: compiled, unlike a generated one; made per request, it pays (README).
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "deterministic", deterministic)
        object.__setattr__(self, "well_typed", well_typed)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def classify(
    endpoint: str,
    body: dict[str, Any],
    *,
    default_temperature: float | None = None,
    seeded_is_deterministic: bool = False,
) -> RequestView:
    model = body.get("model")
    stream = body.get("stream")
    temperature_raw = body.get("temperature")
    top_k_raw = body.get("top_k")
    seed = body.get("seed")

    temperature = default_temperature if temperature_raw is None else _number(temperature_raw)
    well_typed = (
        (model is None or isinstance(model, str))
        and (stream is None or isinstance(stream, bool))
        and (temperature_raw is None or temperature is not None)
        and (top_k_raw is None or (isinstance(top_k_raw, int) and not isinstance(top_k_raw, bool)))
        and (seed is None or (isinstance(seed, int) and not isinstance(seed, bool)))
    )
    deterministic = well_typed and (
        (temperature is not None and temperature < GREEDY_EPSILON)
        or top_k_raw == 1
        or (seeded_is_deterministic and seed is not None)
    )
    return RequestView(
        endpoint=endpoint,
        model=model if isinstance(model, str) else "",
        stream=stream is True,
        deterministic=deterministic,
        well_typed=well_typed,
    )
