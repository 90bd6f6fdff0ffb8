"""The clients' own ``cache_salt`` values the server has sent upstream: a request whose salt
was never sent before found nothing of its tenant in the engine's prefix cache, so its
prefill ran cold (SPEC 1.19: the primary's cache state from what detproxy knows).

One process remembers them in memory. ``serve --workers N``: each worker remembers what it
sent, and a salt new to a worker is looked up in a table every worker of the server shares (a
fixed-size file in their shared folder, mapped in memory, one 8-byte digest a slot, written
under ``flock``): a salt another worker sent is not new. A slot holds the last salt that hashed
to it, so, as with the memory's capacity, a salt unused while 65536 others came may be taken for
new again.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections import OrderedDict

import xxhash

SALTS_KEPT = 65536  # distinct salts remembered (8-byte digests), the least recently sent first out
_SLOT = struct.Struct("<Q")


def _digest(salt: str) -> int:
    return xxhash.xxh3_64_intdigest(salt.encode("utf-8", "surrogatepass")) | 1  # 0: empty


class SharedSalts:
    """The server's table of salts sent: ``slots`` digests in ``path``."""

    def __init__(self, path: str, slots: int = SALTS_KEPT) -> None:
        self._slots = slots
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = slots * _SLOT.size
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # zeros: every slot empty
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._map = mmap.mmap(self._fd, size)

    def first_use(self, digest: int) -> bool:
        """Record ``digest`` as sent; True when no worker had sent it (as far as its slot
        remembers)."""
        offset = (digest % self._slots) * _SLOT.size
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if _SLOT.unpack_from(self._map, offset)[0] == digest:
                return False
            _SLOT.pack_into(self._map, offset, digest)
            return True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


class SaltsSeen:
    def __init__(self, capacity: int = SALTS_KEPT, shared: SharedSalts | None = None) -> None:
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity
        self._shared = shared

    def first_use(self, salt: str) -> bool:
        """Record ``salt`` as sent; True when the server had not sent it before (within the
        last ``capacity`` distinct salts)."""
        digest = _digest(salt)
        seen = self._seen
        if digest in seen:
            seen.move_to_end(digest)
            return False
        seen[digest] = None
        if len(seen) > self._capacity:
            seen.popitem(last=False)
        shared = self._shared
        return shared is None or shared.first_use(digest)

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()


def salts_seen(processes: int, shared_dir: str | None) -> SaltsSeen | None:
    """In memory for one process; with the workers' shared table for several; None where
    several processes share no folder (a salt may then have reached the engine through
    another, so it says nothing)."""
    if processes == 1:
        return SaltsSeen()
    if shared_dir:
        return SaltsSeen(shared=SharedSalts(os.path.join(shared_dir, "salts.bin")))
    return None
