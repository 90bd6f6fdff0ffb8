"""``detproxy sweep``: sustained throughput, TTFT and ITL per concurrency level, with spread."""
