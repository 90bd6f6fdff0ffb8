"""The clients' own ``cache_salt`` values this process has sent upstream: a request whose salt
was never sent before found nothing of its tenant in the engine's prefix cache, so its
prefill ran cold (SPEC 1.19: the primary's cache state from what detproxy knows)."""

from __future__ import annotations

from collections import OrderedDict

import xxhash

SALTS_KEPT = 65536  # distinct salts remembered (8-byte digests), the least recently sent first out


class SaltsSeen:
    def __init__(self, capacity: int = SALTS_KEPT) -> None:
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity

    def first_use(self, salt: str) -> bool:
        """Record ``salt`` as sent; True when this process had not sent it before (within the
        last ``capacity`` distinct salts)."""
        digest = xxhash.xxh3_64_intdigest(salt.encode("utf-8", "surrogatepass"))
        seen = self._seen
        if digest in seen:
            seen.move_to_end(digest)
            return False
        seen[digest] = None
        if len(seen) > self._capacity:
            seen.popitem(last=False)
        return True
