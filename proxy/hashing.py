"""Canonical request keys and stable hashes (xxh3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import xxhash

# Fields that change how an answer is delivered or labelled, not what it says.
_DELIVERY_FIELDS = frozenset({"stream", "stream_options", "request_id", "user"})


def canonical_request_key(body: Mapping[str, Any]) -> str:
    """xxh3-128 of the request with sorted keys, delivery-only fields left out."""
    core = {k: v for k, v in body.items() if k not in _DELIVERY_FIELDS}
    try:
        data = orjson.dumps(core, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # integers beyond 64 bits and the like: fall back to repr
        data = repr(sorted(core.items())).encode()
    return str(xxhash.xxh3_128_hexdigest(data))


def unit_interval(key: str) -> float:
    """Map a key to [0, 1) uniformly: the same key always lands on the same point."""
    return int(xxhash.xxh3_64_intdigest(key.encode())) / 2.0**64
