"""One server's status from its workers': counts summed, the rate computed again, gauges of
live workers only, what every worker sees alike the answering one's."""

from __future__ import annotations

from typing import Any

from proxy.observe.merge import (
    WorkerStatus,
    add_into,
    counter_rows,
    merge_counters,
    merge_injection,
    merge_records,
    merge_status,
)


def status(index: int, pid: int, audits: dict[str, int], inflight: int) -> dict[str, Any]:
    return {
        "version": "0.1.0",
        "worker": {"index": index, "of": 3, "pid": pid},
        "uptime_s": 10.0 + index,
        "inflight": inflight,
        "tasks": 5,
        "audit": {
            "audits": sum(audits.values()),
            "verdicts": audits,
            "modes": {"full": sum(audits.values())},
            "nondeterminism_rate": 0.0,
            "shadows_dropped": {"budget": 1},
            "loops": 2,
        },
        "shadow": {"queued": 1, "running": 1, "primary_tokens": 100, "shadow_tokens": 10},
        "causes": {"m": {"batch": index + 1}},
        "triage": None,
        "passive_pending": 0,
        "injection": {},
        "recovery_budget": {"m": {"generated": 10, "spent": 1, "allowed": 100}},
        "recovery_budget_store": {"store": "memory"},
        "incidents": {"recorded": 3, "written": 3},
        "config": {"worker": index},
    }


def test_counts_add_up_and_an_exited_workers_gauges_do_not() -> None:
    own = status(0, 100, {"identical": 6, "text_divergence": 2}, inflight=4)
    peer = WorkerStatus(1, 101, True, 0.5, status(1, 101, {"identical": 3, "incomparable": 1}, 2))
    gone = WorkerStatus(2, 99, False, 30.0, status(2, 99, {"identical": 1}, inflight=7))
    merged = merge_status(own, [peer, gone])
    audit = merged["audit"]
    assert audit["audits"] == 13 and audit["loops"] == 6
    assert audit["verdicts"] == {"identical": 10, "text_divergence": 2, "incomparable": 1}
    assert audit["nondeterminism_rate"] == 2 / 12  # from the summed verdicts
    assert audit["shadows_dropped"] == {"budget": 3}
    assert merged["causes"] == {"m": {"batch": 6}}
    assert merged["incidents"] == {"recorded": 9, "written": 9}
    # Now: the live workers' only; the exited one's tokens still count.
    assert merged["inflight"] == 6 and merged["tasks"] == 10
    assert merged["shadow"] == {
        "queued": 2,
        "running": 2,
        "primary_tokens": 300,
        "shadow_tokens": 30,
    }
    assert merged["recovery_budget"] == {"m": {"generated": 20, "spent": 2, "allowed": 200}}
    assert merged["uptime_s"] == 11.0
    # The answering worker's own: who answered, its configuration.
    assert merged["worker"]["index"] == 0 and merged["config"] == {"worker": 0}
    lines = {(w["index"], w["pid"]): w for w in merged["workers"]}
    assert lines[(0, 100)]["answered"] and not lines[(1, 101)]["answered"]
    assert not lines[(2, 99)]["alive"]
    assert lines[(2, 99)]["inflight"] == 0 and lines[(2, 99)]["audits"] == 1


def test_a_shared_recovery_budget_is_the_answering_workers() -> None:
    own = status(0, 100, {}, 0) | {"recovery_budget_store": {"store": "redis", "ok": True}}
    peer = WorkerStatus(1, 101, True, 0.1, status(1, 101, {}, 0))
    merged = merge_status(own, [peer])
    assert merged["recovery_budget"] == own["recovery_budget"]  # already every replica's
    assert merged["audit"]["audits"] == 0 and merged["audit"]["nondeterminism_rate"] is None


def test_add_into_nests_and_keeps_what_is_not_a_number() -> None:
    total = add_into({"a": 1, "b": {"c": 2}, "s": "x"}, {"a": 2, "b": {"c": 3, "d": 1}, "s": "y"})
    assert total == {"a": 3, "b": {"c": 5, "d": 1}, "s": "x"}
    assert add_into({"on": False}, {"on": True}) == {"on": True}
    assert add_into({"n": None}, {"n": 4}) == {"n": 4}


def test_injection_suspended_anywhere_is_suspended() -> None:
    a = {"m": {"logprobs": {"suspended": False, "suspended_for_s": None, "failures_in_a_row": 1,
                            "failures_total": 2, "last_status": 400, "last_reason": "old",
                            "last_failed_at": 1.0}}}  # fmt: skip
    b = {"m": {"logprobs": {"suspended": True, "suspended_for_s": 30.0, "failures_in_a_row": 3,
                            "failures_total": 3, "last_status": 422, "last_reason": "new",
                            "last_failed_at": 2.0}}}  # fmt: skip
    merged = merge_injection([a, b])["m"]["logprobs"]
    assert merged["suspended"] and merged["suspended_for_s"] == 30.0
    assert merged["failures_total"] == 5 and merged["failures_in_a_row"] == 3
    assert (merged["last_status"], merged["last_reason"]) == (422, "new")


def test_records_newest_first_and_counters_by_key() -> None:
    merged = merge_records([[{"ts": 3.0}, {"ts": 1.0}], [{"ts": 2.0}, {"ts": 0.5}]])
    assert [r["ts"] for r in merged] == [3.0, 2.0, 1.0, 0.5]
    rows = counter_rows({("m", "full", "identical"): 2})
    summed = merge_counters([rows, [["m", "full", "identical", 3], ["m", "full", "x", 1]]])
    assert summed == {("m", "full", "identical"): 5, ("m", "full", "x"): 1}


def test_an_upstream_event_every_worker_recorded_is_listed_once() -> None:
    def change(ts: float, after: str) -> dict[str, Any]:
        return {"kind": "upstream_change", "ts": ts, "before": {"fingerprint": "a"},
                "after": {"fingerprint": after}}  # fmt: skip

    worker_0 = [change(100.0, "b"), {"kind": "audit", "ts": 50.0}]
    worker_1 = [change(1000.0, "b"), change(120.0, "b"), {"kind": "audit", "ts": 60.0}]
    merged = merge_records([worker_0, worker_1])
    # The change seen 20 s later by worker 1 is the same one; back again 15 min later is not.
    assert [(r["kind"], r["ts"]) for r in merged] == [
        ("upstream_change", 1000.0),
        ("upstream_change", 100.0),
        ("audit", 60.0),
        ("audit", 50.0),
    ]


def test_triage_counts_add_up_and_its_ledger_is_the_servers() -> None:
    def triage(offered: int, tokens: int) -> dict[str, Any]:
        counts = {"offered": offered, "triaged": 1, "explained": 1, "queued": 1}
        return counts | {
            "waiting_incidents": 0,
            "again_incidents": 2,
            "waiting_for": {"rate_limit": 1},
            "running": 0,
            "tokens": tokens,
            "token_budget": 9e3,
        }

    own = status(0, 100, {}, 0) | {"triage": triage(3, 500)}
    peer = WorkerStatus(1, 101, True, 0.1, status(1, 101, {}, 0) | {"triage": triage(4, 400)})
    gone = WorkerStatus(1, 99, False, 9.0, status(1, 99, {}, 0) | {"triage": triage(2, 100)})
    merged = merge_status(own, [peer, gone])["triage"]
    assert (merged["offered"], merged["triaged"], merged["queued"]) == (9, 3, 2)
    # what is waiting now: the live workers' (an exited worker's queue went with it)
    assert merged["again_incidents"] == 4 and merged["waiting_for"] == {"rate_limit": 2}
    assert (merged["tokens"], merged["token_budget"]) == (500, 9000.0)  # one ledger, not 3
