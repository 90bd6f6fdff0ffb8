"""Secrets masked, the one way detproxy masks them, wherever a value of its configuration is
shown: ``/detproxy/status``, incidents and the explorer, log lines, error messages and
``detproxy config``.

A secret is the value of a key named like one (``*token``, ``*api_key``, ``*password``,
``*secret``) and the credentials in a URL: its password, a user given alone (``token@host``:
how some services take a key), a query parameter named like a secret (``?password=...``, which
Redis URLs accept).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from yarl import URL

MASK = "********"
_SECRET_NAME = re.compile(r"(token|api_key|apikey|password|passwd|secret)$", re.IGNORECASE)
# A URL yarl cannot read (a bad port): whatever lies between "//" and the last "@" of the
# authority is masked whole.
_USERINFO = re.compile(r"(?<=//)[^/?#]*@")


def is_secret_name(name: str) -> bool:
    return _SECRET_NAME.search(name) is not None


def mask_url(url: str) -> str:
    """``url`` with its credentials masked (``user:********@host``, ``********@host``,
    ``?password=********``); anything else is left as it is, and a string that is no URL is
    returned unchanged."""
    if "://" not in url:
        return url
    try:
        parsed = URL(url)
    except (TypeError, ValueError):
        return _USERINFO.sub(MASK + "@", url, count=1)
    masked = parsed
    if parsed.password is not None:
        masked = masked.with_password(MASK)
    elif parsed.user:
        masked = masked.with_user(MASK)
    if any(is_secret_name(name) for name in parsed.query):
        masked = masked.with_query(
            [(k, MASK if is_secret_name(k) else v) for k, v in parsed.query.items()]
        )
    return url if masked is parsed else str(masked)


def mask_secrets(tree: Any, name: str = "") -> Any:
    """``tree`` (JSON-like: mappings, lists, strings, ...) with the values of secret keys and
    the credentials in URLs replaced by ``MASK``."""
    if isinstance(tree, Mapping):
        return {k: mask_secrets(v, str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):  # the items of a secret key are secrets too
        return [mask_secrets(v, name) for v in tree]
    if isinstance(tree, str):
        return MASK if is_secret_name(name) else mask_url(tree)
    return tree
