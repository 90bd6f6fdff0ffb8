"""How busy the upstream says it is, read from its /metrics: vLLM's and llama-server's gauges."""

from __future__ import annotations

from proxy.engine.load import EngineCounts, UpstreamLoad, parse_running
from proxy.http.errors import UpstreamFailure
from proxy.testing import MockUpstream, Received, Reply

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_running_other 7.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
"""

# llama-server --metrics: no labels, integers (the ``llamacpp:`` names of its metrics handler).
LLAMA = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""


def test_vllm_running_is_summed_over_engines() -> None:
    assert parse_running(VLLM) == 3.0


def test_llama_server_processing_counts_as_running() -> None:
    assert parse_running(LLAMA) == 1.0
    assert parse_running(LLAMA.replace("requests_processing 1", "requests_processing 0")) == 0.0


def test_no_such_gauge_is_unknown() -> None:
    assert parse_running("llamacpp:requests_deferred 3\nother 1\n") is None


async def test_a_quiet_llama_server_reads_as_quiet() -> None:
    """What ``schedule = "quiet"`` with ``quiet_max_upstream_running`` asks between polls."""
    state = {"text": LLAMA}
    engine = MockUpstream(routes={"/metrics": lambda request: Reply.text(state["text"])})
    load = UpstreamLoad(engine, "http://user:secret@engine:8000")
    assert await load.running() == 1
    state["text"] = LLAMA.replace("requests_processing 1", "requests_processing 0")
    assert await load.running() == 0
    read = engine.received("/metrics")[0]
    assert (read.method, read.headers["Authorization"]) == ("GET", "Basic dXNlcjpzZWNyZXQ=")


async def test_an_upstream_that_cannot_answer_is_unknown() -> None:
    """Refused, an error page, no answer in time: no load known, and nothing raised."""

    slow = Reply(200, body=LLAMA.encode(), delay_s=10)  # past the read's timeout

    def refused(request: Received) -> Reply:
        raise UpstreamFailure(502, "upstream refused the connection", "refused")

    for metrics in (refused, Reply.error(500, "boom"), slow):
        engine = MockUpstream(routes={"/metrics": metrics})
        assert await UpstreamLoad(engine, "http://engine", timeout_s=0.05).running() is None
        assert engine.received("/metrics"), "it was asked"


async def test_vllm_counts_read_running_and_finished_in_one_read() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0\n'
    )
    engine = MockUpstream(routes={"/metrics": lambda request: Reply.text(text)})
    assert await UpstreamLoad(engine, "http://engine").counts() == EngineCounts(1, 10)
    quiet = MockUpstream(
        routes={"/metrics": lambda request: Reply.text("llamacpp:requests_processing 0\n")}
    )
    assert await UpstreamLoad(quiet, "http://engine").counts() == EngineCounts(0, None)
    none = MockUpstream(routes={"/metrics": lambda request: Reply.text("other 1\n")})
    assert await UpstreamLoad(none, "http://engine").counts() is None
