"""``detproxy report``: read incident logs and summarise the determinism audit."""
