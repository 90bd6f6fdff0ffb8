"""Each cause of divergence injected on its own: the one flag on, everything else bit-identical."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.tools.emulator.cli import build_parser, config_from_args
from tests.helpers.emulator import EmulatorClient, chat, completion
from tests.helpers.sse import stream_text

from .conftest import MakeClient

LONG = (
    "Explain in great detail, with many words and examples, how a prefix cache in a large"
    " language model server works and why it matters for latency"
)


def long_chat(i: int = 0, **extra: Any) -> dict[str, Any]:
    """A greedy chat request whose prompt spans more than one KV block (so it can be warm)."""
    messages = [{"role": "user", "content": f"Question {i}. {LONG}"}]
    return chat(messages=messages, max_tokens=16, logprobs=True, top_logprobs=3, **extra)


def answer(body: dict[str, Any]) -> Any:
    """What must be bit-identical between two runs: the choices (text and logprobs)."""
    return body["choices"]


async def ask(client: EmulatorClient, body: dict[str, Any], rid: str | None = None) -> Any:
    reply = await client.chat(body, headers={"X-Request-Id": rid} if rid else None)
    assert reply.status == 200, f"emulator answered {reply.status}: {reply.raw[:200]!r}"
    return reply.json()


def kinds(records: list[dict[str, Any]]) -> set[str]:
    return {r["kind"] for r in records}


async def test_stable_emulator_is_bit_identical_serial_and_concurrent(
    make_client: MakeClient,
) -> None:
    client, server = await make_client(token_latency_s=0.002)
    req = long_chat()
    first = answer(await ask(client, req))
    serial = [answer(await ask(client, req)) for _ in range(20)]
    concurrent = await asyncio.gather(*(ask(client, req) for _ in range(20)))
    assert all(a == first for a in serial), "stable emulator: a serial answer differs"
    assert all(answer(b) == first for b in concurrent), "stable emulator: a concurrent differs"
    assert server.injections() == [], f"stable emulator injected: {server.injections()}"


async def test_intrinsic_flip_varies_per_request_alone_in_flight(make_client: MakeClient) -> None:
    base_client, _ = await make_client()
    client, server = await make_client(flip_probability=0.5, flip_position=2, seed=5)
    req = long_chat()
    base = answer(await ask(base_client, req))
    texts = {}
    for i in range(20):
        texts[f"s{i}"] = answer(await ask(client, req, f"s{i}"))
    recs = server.injections()
    assert kinds(recs) == {"flip"}, f"intrinsic alone injected other kinds: {kinds(recs)}"
    assert all(r["inflight"] == 1 for r in recs), "a flip was not at one request in flight"
    flipped = {r["request_id"] for r in recs}
    assert 0 < len(flipped) < 20, f"flip_probability 0.5 flipped {len(flipped)} of 20"
    for rid, got in texts.items():
        assert (got != base) == (rid in flipped), f"{rid}: text change and record disagree"
    assert len({str(t) for t in texts.values()}) == 2  # flipped and unflipped, nothing else


async def test_batch_never_alone_and_diverges_under_concurrency(make_client: MakeClient) -> None:
    client, server = await make_client(batch_divergence_slope=1.0, token_latency_s=0.002)
    req = long_chat()
    serial = [answer(await ask(client, req)) for _ in range(10)]
    assert all(s == serial[0] for s in serial), "batch cause: serial answers differ"
    assert server.injections() == [], "batch cause fired with one request in flight"
    concurrent = await asyncio.gather(*(ask(client, req, f"c{i}") for i in range(4)))
    recs = server.injections()
    assert kinds(recs) == {"batch_drift", "batch_divergence"}, f"other kinds: {kinds(recs)}"
    assert all(r["inflight"] > 1 for r in recs)
    assert all(answer(c) != serial[0] for c in concurrent), "batch cause: concurrent unchanged"


async def test_prefix_cache_cold_agrees_warm_agrees_cold_differs_from_warm(
    make_client: MakeClient,
) -> None:
    client, server = await make_client(warm_cache_divergence=1.0, enable_prompt_tokens_details=True)
    req = long_chat()
    cold = [await ask(client, long_chat(cache_salt=f"cold-{i}")) for i in range(3)]
    await ask(client, long_chat(cache_salt="warm"))  # fills the cache for salt "warm"
    warm = [await ask(client, long_chat(cache_salt="warm"), f"w{i}") for i in range(3)]
    assert all(c["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} for c in cold)
    cached = [w["usage"]["prompt_tokens_details"]["cached_tokens"] for w in warm]
    assert all(c >= 16 and c % 16 == 0 for c in cached), f"warm cached_tokens {cached}"
    assert all(answer(c) == answer(cold[0]) for c in cold), "cold answers differ"
    assert all(answer(w) == answer(warm[0]) for w in warm), "warm answers differ"
    assert answer(warm[0]) != answer(cold[0]), "warm answer equals the cold one"
    recs = server.injections()
    assert kinds(recs) == {"prefix_cache"}, f"other kinds: {kinds(recs)}"
    assert sorted(r["request_id"] for r in recs) == ["w0", "w1", "w2"]
    pos = recs[0]["position"]
    assert 0 <= pos < 10 and all(r["position"] == pos for r in recs)
    cold_tokens = cold[0]["choices"][0]["logprobs"]["content"]
    warm_tokens = warm[0]["choices"][0]["logprobs"]["content"]
    assert warm_tokens[:pos] == cold_tokens[:pos]
    assert warm_tokens[pos]["token"] == cold_tokens[pos]["top_logprobs"][1]["token"]
    assert recs[0]["detail"]["cached_tokens"] == cached[0]
    # The same prompt without a salt is its own partition: cold first, then warm.
    unsalted = [answer(await ask(client, req)) for _ in range(2)]
    assert unsalted == [answer(cold[0]), answer(warm[0])]
    metrics = await client.session.get(client.base + "/metrics")
    text = await metrics.text()
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total{")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) == sum(cached) + cached[0]


async def test_prefix_cache_streams_the_same_warm_answer(make_client: MakeClient) -> None:
    client, server = await make_client(warm_cache_divergence=1.0)
    cold = await ask(client, long_chat(cache_salt="a"))
    warm = await ask(client, long_chat(cache_salt="a"))
    streamed = await client.chat(long_chat(cache_salt="a", stream=True))
    text = stream_text(streamed.events())
    assert text == warm["choices"][0]["message"]["content"], "streamed warm answer differs"
    assert text != cold["choices"][0]["message"]["content"]
    assert [r["kind"] for r in server.injections()] == ["prefix_cache", "prefix_cache"]


async def test_prefix_cache_is_per_prompt_in_a_completions_batch(make_client: MakeClient) -> None:
    client, server = await make_client(warm_cache_divergence=1.0)
    a, b = f"Alpha. {LONG}", f"Beta. {LONG}"
    cold = (await client.completion(completion(prompt=[a, b], max_tokens=12))).json()
    # a is now cached; a new prompt c stays cold beside it.
    c = f"Gamma. {LONG}"
    mixed = (await client.completion(completion(prompt=[a, c], max_tokens=12))).json()
    alone_c = (await client.completion(completion(prompt=c, max_tokens=12, cache_salt="x"))).json()
    assert mixed["choices"][0]["text"] != cold["choices"][0]["text"], "warm prompt a unchanged"
    assert mixed["choices"][1]["text"] == alone_c["choices"][0]["text"], "cold prompt c changed"
    recs = server.injections()
    assert [(r["kind"], r["choice"]) for r in recs] == [("prefix_cache", 0)]


async def test_prefix_cache_off_nothing_is_warm(make_client: MakeClient) -> None:
    client, server = await make_client(
        warm_cache_divergence=1.0, enable_prefix_caching=False, enable_prompt_tokens_details=True
    )
    replies = [await ask(client, long_chat(cache_salt="same")) for _ in range(5)]
    assert all(answer(r) == answer(replies[0]) for r in replies), "prefix caching off: differs"
    assert all(r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} for r in replies)
    assert server.injections() == []
    metrics = await client.session.get(client.base + "/metrics")
    text = await metrics.text()
    assert 'enable_prefix_caching="False"' in text


async def test_prompt_tokens_details_only_with_the_flag(make_client: MakeClient) -> None:
    client, _ = await make_client()
    await ask(client, long_chat())
    warm = await ask(client, long_chat())
    assert warm["usage"]["prompt_tokens_details"] is None


async def test_warm_cache_share_is_chosen_by_prompt(make_client: MakeClient) -> None:
    async def affected() -> set[int]:
        client, server = await make_client(warm_cache_divergence=0.5)
        for i in range(30):
            await ask(client, long_chat(i))
            await ask(client, long_chat(i), f"warm-{i}")
        assert kinds(server.injections()) <= {"prefix_cache"}
        return {int(r["request_id"].split("-")[1]) for r in server.injections()}

    first, second = await affected(), await affected()
    assert first == second, "the prompts a warm cache changes are not the same twice"
    assert 5 < len(first) < 25, f"share 0.5 affected {len(first)} of 30 prompts"


async def test_speculative_differs_from_plain_and_agrees_with_itself(
    make_client: MakeClient,
) -> None:
    async def answers(**fields: Any) -> tuple[list[Any], set[int]]:
        client, server = await make_client(seed=11, **fields)
        out = [
            answer(await ask(client, long_chat(i, cache_salt=f"s{i}"), f"r-{i}")) for i in range(20)
        ]
        recs = server.injections()
        assert kinds(recs) <= {"speculative"}, f"other kinds: {kinds(recs)}"
        return out, {int(r["request_id"].split("-")[1]) for r in recs}

    plain, none = await answers()
    spec, hit = await answers(speculative=True, speculative_divergence=0.5)
    again, hit_again = await answers(speculative=True, speculative_divergence=0.5)
    assert none == set()
    assert spec == again and hit == hit_again, "the speculative recipe disagrees with itself"
    assert 0 < len(hit) < 20, f"share 0.5 affected {len(hit)} of 20 prompts"
    for i in range(20):
        assert (spec[i] != plain[i]) == (i in hit), f"prompt {i}: change and record disagree"
    # Speculative decoding without the divergence flag leaves every answer as plain greedy.
    quiet, _ = await answers(speculative=True)
    assert quiet == plain
    # The divergence flag without --speculative does nothing.
    off, off_hit = await answers(speculative_divergence=1.0)
    assert off == plain and off_hit == set()


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--warm-cache-divergence", "0.3"], "warm_cache_divergence", 0.3),
        (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
        (["--enable-prompt-tokens-details"], "enable_prompt_tokens_details", True),
        (["--speculative", "--speculative-divergence", "0.4"], "speculative_divergence", 0.4),
    ],
)
def test_cause_flags_reach_the_config(argv: list[str], field: str, value: object) -> None:
    cfg = config_from_args(build_parser().parse_args(argv))
    assert getattr(cfg, field) == value


def test_help_names_each_cause_and_its_flag() -> None:
    text = build_parser().format_help()
    for cause, flag in [
        ("intrinsic", "--flip-probability"),
        ("batch", "--batch-divergence-slope"),
        ("prefix_cache", "--warm-cache-divergence"),
        ("speculative", "--speculative-divergence"),
        ("recipe_change", "--vllm-version"),
    ]:
        lines = [ln for ln in text.splitlines() if ln.strip().split()[:1] == [cause]]
        assert any(flag in ln for ln in lines), f"--help does not pair {cause} with {flag}"


async def test_causes_combine_and_each_request_says_what_changed_it(
    make_client: MakeClient,
) -> None:
    """Batch and cache in one emulator: each record names its one effect, and one request's
    records (``?request_id=``, ``injections(request_id)``) are what changed its answer."""
    client, server = await make_client(
        batch_divergence_slope=1.0, warm_cache_divergence=1.0, token_latency_s=0.002
    )
    req = long_chat(7)
    cold = answer(await ask(client, req, "cold"))  # alone, nothing cached: untouched
    warm = answer(await ask(client, req, "warm"))  # alone, cached: the cache's effect only
    both = await asyncio.gather(*(ask(client, req, f"both{i}") for i in range(3)))
    assert server.injections("cold") == []
    assert kinds(server.injections("warm")) == {"prefix_cache"} and warm != cold
    for i, body in enumerate(both):
        got = kinds(server.injections(f"both{i}"))
        assert {"prefix_cache", "batch_drift"} <= got, got
        assert answer(body) not in (cold, warm)
    reply = await client.get("/emulator/injections?request_id=warm")
    assert reply.json() == server.injections("warm")
    assert len(server.injections()) == sum(
        len(server.injections(rid)) for rid in ("cold", "warm", "both0", "both1", "both2")
    )
