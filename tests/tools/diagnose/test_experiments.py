"""How diagnose talks to an engine: through the upstream seam (proxy.http.upstream), its key on
every request, the seam's faults as one-line DiagnoseErrors."""

from __future__ import annotations

import pytest

from proxy.http.errors import UpstreamFailure
from proxy.testing import MockUpstream, Received, Reply, answers
from proxy.tools.diagnose.experiments import DiagnoseError, Settings, Upstream

SETTINGS = Settings(model="m", runs=2, max_tokens=4, top_logprobs=5, levels=(1,))


async def test_every_request_carries_the_key_and_goes_through_the_seam() -> None:
    mock = MockUpstream(answers("yes", model="m"))
    mock.on("/version", Reply.json({"version": "0.23.0"}))
    mock.on("/metrics", Reply.text('vllm:num_requests_running{engine="0"} 2.0\n'))
    engine = Upstream("http://u:p@engine:8000", SETTINGS, "sk-1", client=mock)
    identified = await engine.identify()
    assert (identified.kind, identified.version) == ("vllm", "0.23.0")
    assert await engine.negotiate("hi") == 5
    answer = await engine.ask("hi", 4, {})
    assert answer.choice.content == "yes"
    assert await engine.running() == 2.0
    asked = [(r.method, r.path, r.headers.get("Authorization")) for r in mock.requests]
    assert {auth for *_, auth in asked} == {"Bearer sk-1"}, asked
    posted = mock.bodies("/v1/chat/completions")
    assert posted[-1]["top_logprobs"] == 5 and posted[-1]["max_tokens"] == 4
    assert {path for _, path, _ in asked} == {
        "/v1/models",
        "/version",
        "/props",
        "/v1/chat/completions",
        "/metrics",
    }


async def test_an_engine_that_cannot_be_reached_is_one_diagnose_error() -> None:
    def refuse(request: Received) -> Reply:
        raise UpstreamFailure(502, "upstream refused the connection: nothing there", "refused")

    engine = Upstream("http://engine:8000", SETTINGS, None, client=MockUpstream(refuse))
    with pytest.raises(DiagnoseError, match="cannot reach http://engine:8000: upstream refused"):
        await engine.identify()
    with pytest.raises(DiagnoseError, match="cannot reach http://engine:8000/v1/chat"):
        await engine.ask("hi", 4, {})
    assert await engine.running() is None, "a load it cannot read is unknown, not an error"


async def test_a_refused_key_says_how_to_pass_one() -> None:
    mock = MockUpstream(routes={"/v1/models": Reply.error(401, "no key")})
    engine = Upstream("http://engine:8000", SETTINGS, None, client=mock)
    with pytest.raises(DiagnoseError, match=r"answered 401 \(no API key\): pass the key"):
        await engine.identify()
