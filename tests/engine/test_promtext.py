"""proxy.engine.promtext: the samples of a Prometheus text, as the upstream readers want them."""

from __future__ import annotations

from proxy.engine.promtext import samples, sum_samples

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a b {c}"} 2.0
vllm:num_requests_running{engine="1",model_name="x"} 3 1700000000000
vllm:num_requests_running_total{engine="0"} 100.0
vllm:num_requests_waiting\t4
vllm:num_requests_waiting{engine="0"} NaN-ish
llamacpp:requests_processing 1
vllm:prefix_cache_hits_total{engine="0"} +Inf
"""


def test_sums_over_label_sets_and_ignores_longer_names() -> None:
    totals = sum_samples(TEXT, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    # label values with spaces and braces, a timestamp after the value, a tab separator; a
    # value that is not a number is skipped; ..._running_total is another metric.
    assert totals == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 4.0}


def test_names_absent_are_absent() -> None:
    assert sum_samples(TEXT, ("vllm:gpu_cache_usage_perc",)) == {}
    assert sum_samples("", ("x",)) == {}


def test_samples_by_prefix_in_order() -> None:
    found = list(samples(TEXT, ("llamacpp:", "vllm:prefix_")))
    assert found == [
        ("llamacpp:requests_processing", 1.0),
        ("vllm:prefix_cache_hits_total", float("inf")),
    ]
