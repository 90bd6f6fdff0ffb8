"""``build_app(settings)``: the admin routes, the upstream clients (every request to an engine,
its reads included, goes through the ``Upstream`` seam, to clients of one kind:
``build_app(upstream=)`` swaps them all), and what lives as long as the app. The aiohttp
``Application`` is the container of that lifetime (its ``cleanup_ctx``) and of what the
listeners serve: ``RUNTIME``'s forwarder the proxied routes, ``ADMIN`` detproxy's own;
``proxy.serving`` puts both on the lean front's listeners."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from policies.base import PolicyChain
from policies.budget import RecoveryBudget
from policies.ladder import Ladder, LoopLadderPolicy
from proxy import __version__
from proxy.attribution.account import triage_account
from proxy.attribution.shared import shared_experiments
from proxy.attribution.triage import Triage
from proxy.audit.auditor import Auditor
from proxy.audit.salts import salts_seen
from proxy.audit.server_load import shared_load
from proxy.audit.shadow import ProxyLoad, ShadowScheduler
from proxy.audit.store import DuplicateStore, MemoryDuplicateStore
from proxy.audit.turns import engine_turns
from proxy.config import Settings, UpstreamConfig
from proxy.engine.fingerprint import FingerprintPoller
from proxy.engine.follow import EngineLogFollower, EngineTruth
from proxy.engine.invariance import BatchInvarianceCheck
from proxy.engine.load import UpstreamLoad
from proxy.events import EventBus
from proxy.forward import Forwarder
from proxy.http.admin import HEALTH, Admin, AdminRequest, Reply, json_reply
from proxy.http.admin import METRICS as METRICS_PATH
from proxy.http.eventloop import loop_name
from proxy.http.h1 import H1Upstream
from proxy.http.upstream import Upstream
from proxy.injection import InjectionGuard
from proxy.loops.budget_folder import FolderBudgetSync
from proxy.loops.recovery import Recovery
from proxy.observe.fleet import Fleet
from proxy.observe.incidents import IncidentLog
from proxy.observe.metrics import Metrics
from proxy.observe.status import AuditTally
from proxy.observe.ui.history import LiveHistory
from proxy.observe.ui.routes import register_ui
from proxy.observe.view import ServerView
from proxy.redact import mask_secrets, mask_url
from proxy.relay.inspectors import InspectorFactory
from proxy.selfloop import new_server_id
from proxy.tasks import TaskOwner
from proxy.workers import MULTIPROC_ENV, WORKER, live_worker_pids, worker_status

if TYPE_CHECKING:
    from proxy.loops.budget_sync import RedisBudgetSync

SETTINGS = web.AppKey("settings", Settings)
BUS = web.AppKey("bus", EventBus)
METRICS = web.AppKey("metrics", Metrics)
STARTED_AT = web.AppKey("started_at", float)
INCIDENTS = web.AppKey("incidents", IncidentLog)
TALLY = web.AppKey("tally", AuditTally)
ADMIN = web.AppKey("admin", Admin)  # /detproxy/...: its routes and their guard


@dataclass(frozen=True, slots=True)
class Runtime:
    """What exists only while the app runs (created in ``cleanup_ctx``)."""

    forwarder: Forwarder
    scheduler: ShadowScheduler | None
    auditor: Auditor | None
    fingerprint: FingerprintPoller | None
    recovery_budget: RecoveryBudget
    engine: EngineTruth | None = None  # what the engine says it loaded, against [upstream.expect]
    triage: Triage | None = None  # follow-up experiments on divergent audits: their causes
    invariance: BatchInvarianceCheck | None = None  # declared batch invariance, checked


RUNTIME = web.AppKey("runtime", Runtime)
BUDGET_SYNC = web.AppKey["RedisBudgetSync | FolderBudgetSync | None"]("budget_sync")
TARGET = web.AppKey[Upstream]("target")  # the upstream requests are forwarded to
REFERENCE = web.AppKey[Upstream | None]("reference")  # the control engine shadows go to
# The engine reads' (fingerprint, load): the target's client, or, where the app made that one,
# another of the same kind, so that a pool full of proxied requests never holds a reading back
# past its timeout (a false outage); with ``build_app(upstream=)``, the one given.
READS = web.AppKey[Upstream]("reads")


def _duplicate_store(settings: Settings) -> DuplicateStore:
    audit = settings.audit
    if audit.duplicate_store == "redis":
        from proxy.audit.redis_store import RedisDuplicateStore  # the optional `redis` extra

        return RedisDuplicateStore(audit.redis_url, audit.duplicate_window_s)
    return MemoryDuplicateStore(audit.duplicate_window_s, audit.duplicate_max_entries)


def _make_upstream(config: UpstreamConfig, url: str, server_id: str) -> H1Upstream:
    return H1Upstream(
        url,
        connect_timeout_s=config.connect_timeout_s,
        read_timeout_s=config.read_timeout_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        max_connections=config.max_connections,
        server_id=server_id,
    )


def _scheduler(
    settings: Settings,
    upstream: Upstream,
    reference: Upstream | None,
    bus: EventBus,
    traffic: ProxyLoad,
    guard: InjectionGuard,
    load: UpstreamLoad,
) -> ShadowScheduler | None:
    """``load``: how busy the engine the shadows go to is."""
    audit = settings.audit
    rates = (audit.sample_rate, *audit.model_rates.values())
    if audit.at_least_every_s <= 0 and not any(r > 0 for r in rates):
        return None  # audit off: no rate and no floor
    target = reference or upstream
    # max_concurrent_shadows is the server's: its workers take turns in their shared folder.
    shared = os.environ.get(MULTIPROC_ENV)
    turns = engine_turns(audit.max_concurrent_shadows, settings.server.processes, shared)
    return ShadowScheduler(
        audit,
        target,
        bus,
        traffic,
        load.running if audit.quiet_max_upstream_running is not None else None,
        guard,
        turns,
    )


def _triage(
    settings: Settings,
    upstream: Upstream,
    reference: Upstream | None,
    bus: EventBus,
    traffic: ProxyLoad,
    scheduler: ShadowScheduler | None,
    load: UpstreamLoad,
    *,
    sees_server: bool,
) -> Triage | None:
    """Triage needs divergences to follow (shadows', or the passive duplicate checks') and a
    rate above 0. ``sees_server``: ``traffic`` counts every client request of the server."""
    if settings.attribution.triage_rate <= 0:
        return None
    if scheduler is None and not settings.audit.passive_checks:
        return None
    audit = settings.audit
    # The server's budget and turns: the workers' shared folder where there are several.
    shared, processes = os.environ.get(MULTIPROC_ENV), settings.server.processes
    turns = (
        scheduler.turns
        if scheduler is not None
        else engine_turns(audit.max_concurrent_shadows, processes, shared)
    )
    triage = Triage(
        settings.attribution,
        audit,
        bus,
        upstream,
        traffic,
        reference=reference,
        scheduler=scheduler,
        upstream_running=load.running if audit.quiet_max_upstream_running is not None else None,
        engine_running=load.running,
        engine_counts=load.counts,
        sees_all=sees_server,
        account=triage_account(settings.attribution, processes, shared),
        turns=turns,
        shared=shared_experiments(processes, shared, settings.attribution.reuse_s),
    )
    triage.subscribe(bus)
    return triage


def _invariance(  # noqa: PLR0913 (what it reuses of the app, one argument each)
    settings: Settings,
    upstream: Upstream,
    bus: EventBus,
    forwarder: Forwarder,
    engine: EngineTruth,
    load: UpstreamLoad,
    *,
    poller: FingerprintPoller | None,
    scheduler: ShadowScheduler | None,
    triage: Triage | None,
) -> BatchInvarianceCheck | None:
    """Only where ``[upstream.expect] batch_invariant = true`` is declared."""
    if settings.upstream.expect.batch_invariant is not True:
        return None
    audit = settings.audit

    def busy() -> bool:
        return (scheduler is not None and scheduler.sending > 0) or (
            triage is not None and triage.running
        )

    check = BatchInvarianceCheck(
        engine,
        upstream,
        forwarder,
        audit,
        settings.attribution,
        follows_identity=poller is not None,
        busy=busy,
        upstream_running=load.running if audit.quiet_max_upstream_running is not None else None,
    )
    check.subscribe(bus)
    return check


def _shown_target(settings: Settings) -> str:
    """Where shadows go, as incidents (and so the explorer) say it: the reference engine's URL
    with its credentials masked, or "same" (the upstream)."""
    reference = settings.audit.reference_url
    return mask_url(reference) if reference else "same"


def _recovery_budget(settings: Settings) -> RecoveryBudget:
    loops = settings.loops
    return RecoveryBudget(
        loops.recovery_token_share, loops.recovery_token_floor, loops.recovery_window_s
    )


def _policy_chain(settings: Settings, budget: RecoveryBudget) -> PolicyChain:
    """The default chain: the loop ladder."""
    loops = settings.loops
    ladders = [
        Ladder(lad.models, lad.action, tuple(lad.attempts), lad.on_exhausted)
        for lad in loops.ladder_list()
    ]
    return PolicyChain([LoopLadderPolicy(ladders, budget)])


def build_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    upstream: Upstream | None = None,
    inspector_factories: Sequence[InspectorFactory] = (),
    policies: PolicyChain | None = None,
    clock: Callable[[], float] = time.monotonic,
    server_id: str | None = None,
    fleet_dir: Path | None = None,
) -> web.Application:
    """``clock``: the time request durations and stream speeds are measured on.
    ``server_id``: what this server's upstream requests carry in ``X-Detproxy-Via``, so that
    one coming back is known (proxy/selfloop.py); a fresh one unless given (``--workers``
    share their supervisor's). ``fleet_dir``: a worker's (``--workers``), where every worker
    publishes its figures and reads the others' (proxy/observe/fleet.py)."""
    app = web.Application()
    bus = EventBus()
    metrics = Metrics(
        registry if registry is not None else CollectorRegistry(),
        # Redis or the workers' folder: every worker reports the one account, whole.
        budget_shared=settings.loops.recovery_budget_store == "redis" or fleet_dir is not None,
    )
    metrics.subscribe(bus)
    budget = _recovery_budget(settings)
    chain = policies or _policy_chain(settings, budget)
    guard = InjectionGuard(settings.injection, bus)
    recovery = Recovery(
        settings.loops, chain, bus, guard, budget if settings.loops.enabled else None
    )
    app[SETTINGS] = settings
    app[BUS] = bus
    app[METRICS] = metrics
    app[STARTED_AT] = time.time()

    tally = AuditTally()
    tally.subscribe(bus)
    # Incidents name the process of the tally lines that count them (detproxy report).
    incidents = IncidentLog(settings.incidents, process=tally.process)
    incidents.subscribe(bus)
    metrics.watch_failures(
        {
            "subscriber": lambda: dict(bus.failures),
            "policy": lambda: dict(chain.failures),
            "incident_log": incidents.failures,
        }
    )
    app[INCIDENTS] = incidents
    app[TALLY] = tally

    lifetime = _Lifetime(
        settings,
        bus,
        recovery,
        guard,
        budget,
        incidents,
        tally,
        upstream,
        inspector_factories,
        clock,
        server_id or new_server_id(),
        fleet_dir,
    )
    app.cleanup_ctx.extend(lifetime.contexts())
    admin = app[ADMIN] = Admin(settings.server)
    admin.add(HEALTH, _health)
    admin.add(METRICS_PATH, metrics.handle)
    history = LiveHistory()  # the explorer's audits over time
    history.subscribe(bus)
    fleet = Fleet(fleet_dir) if fleet_dir is not None else None
    view = ServerView(incidents, tally, history, fleet, live_worker_pids)
    if fleet is not None:  # --workers: this worker's figures published for the others
        fleet.subscribe(bus)
        app.cleanup_ctx.append(_publishing(view, fleet))
    register_ui(admin, view)
    admin.add("/detproxy/status", lambda request: _status(app, view))
    admin.add("/detproxy/incidents", view.incidents_handler)
    return app


@dataclass(frozen=True, slots=True)
class _Lifetime:
    """What lives as long as the app, one cleanup context per resource. aiohttp starts them in
    ``contexts()`` order and cleans them up in the reverse one: background tasks first, then the
    shadow workers, the passive checks, the incident log (the tally's last line, then what its
    writer has queued), the upstream clients last."""

    settings: Settings
    bus: EventBus
    recovery: Recovery
    guard: InjectionGuard
    budget: RecoveryBudget
    incidents: IncidentLog
    tally: AuditTally
    upstream: Upstream | None  # the caller's, not closed with the app
    inspector_factories: Sequence[InspectorFactory]
    clock: Callable[[], float]
    server_id: str  # marks what goes upstream: X-Detproxy-Via
    fleet_dir: Path | None  # a worker's (--workers): the folder the workers share

    def contexts(self) -> list[Callable[[web.Application], AsyncIterator[None]]]:
        return [
            self.target_ctx,
            self.reads_ctx,
            self.reference_ctx,
            self.incidents_ctx,
            self.runtime_ctx,
            self.auditor_ctx,
            self.scheduler_ctx,
            self.triage_ctx,
            self.invariance_ctx,
            self.fingerprint_ctx,
            self.tally_ctx,
            self.budget_sync_ctx,
        ]

    async def target_ctx(self, app: web.Application) -> AsyncIterator[None]:
        if self.upstream is not None:
            app[TARGET] = self.upstream
            yield
            return
        config = self.settings.upstream
        target = app[TARGET] = _make_upstream(config, config.url, self.server_id)
        yield
        await target.close()

    async def reads_ctx(self, app: web.Application) -> AsyncIterator[None]:
        if self.upstream is not None:
            app[READS] = self.upstream
            yield
            return
        config = self.settings.upstream
        reads = app[READS] = _make_upstream(config, config.url, self.server_id)
        yield
        await reads.close()

    async def reference_ctx(self, app: web.Application) -> AsyncIterator[None]:
        url, upstream = self.settings.audit.reference_url, self.settings.upstream
        reference = _make_upstream(upstream, url, self.server_id) if url else None
        app[REFERENCE] = reference
        yield
        if reference is not None:
            await reference.close()

    async def incidents_ctx(self, app: web.Application) -> AsyncIterator[None]:
        self.incidents.start()  # the file's writer: it outlives what publishes incidents
        yield
        if self.incidents.on_disk:
            self.incidents.write(self.tally.summary())  # the last word of this process
        await self.incidents.close()

    async def runtime_ctx(self, app: web.Application) -> AsyncIterator[None]:
        # Wiring only: what it builds is started and stopped by the contexts after it.
        settings, bus, guard = self.settings, self.bus, self.guard
        target, reference, reads = app[TARGET], app[REFERENCE], app[READS]
        forwarder = Forwarder(
            settings,
            target,
            bus,
            self.recovery,
            self.inspector_factories,
            guard,
            self.clock,
            server_id=self.server_id,
        )
        # How busy the engines are, read as the fingerprint is (``READS``); the reference's
        # through its own client, which only shadows use.
        load = UpstreamLoad(reads, settings.upstream.url)
        # detproxy's own traffic as shadows, triage and the audit read it: every worker's
        # where there are several (a primary's company may be another worker's client).
        identity = app.get(WORKER)
        shared = shared_load(
            settings.server.processes,
            os.environ.get(MULTIPROC_ENV),
            identity.index if identity is not None else None,
        )
        traffic: ProxyLoad = forwarder
        if shared is not None:
            forwarder.share_load(shared)
            traffic = shared
        sees_server = settings.server.one_process or shared is not None
        reference_url = settings.audit.reference_url
        shadows_load = (
            UpstreamLoad(reference, reference_url)
            if reference is not None and reference_url
            else load
        )
        scheduler = _scheduler(settings, target, reference, bus, traffic, guard, shadows_load)
        store = _duplicate_store(settings) if settings.audit.passive_checks else None
        triage = _triage(
            settings, target, reference, bus, traffic, scheduler, load, sees_server=sees_server
        )
        auditor = None
        if scheduler is not None or store is not None:
            auditor = Auditor(
                settings,
                bus,
                scheduler,
                store,  # the auditor's: closed with it
                traffic.inflight_now,
                target=_shown_target(settings),
                guard=guard,
                triage=triage.offer if triage is not None else None,
                count_primary_tokens=triage.count_primary_tokens if triage is not None else None,
                salts=salts_seen(settings.server.processes, os.environ.get(MULTIPROC_ENV)),
                sees_server=sees_server,
            )
            forwarder.attach_auditor(auditor)
        poller = None
        upstream = settings.upstream
        engine = EngineTruth(bus, upstream.expect.declared(), upstream.engine_log)
        if upstream.engine_log:
            EngineLogFollower(upstream.engine_log, engine)  # attaches itself as engine.follower
        if upstream.fingerprint_interval_s > 0:
            poller = FingerprintPoller(
                reads, upstream.url, bus, upstream.fingerprint_interval_s, truth=engine
            )
        invariance = _invariance(
            settings,
            target,
            bus,
            forwarder,
            engine,
            load,
            poller=poller,
            scheduler=scheduler,
            triage=triage,
        )
        app[RUNTIME] = Runtime(
            forwarder, scheduler, auditor, poller, self.budget, engine, triage, invariance
        )
        yield
        if shared is not None:
            shared.close()

    async def auditor_ctx(self, app: web.Application) -> AsyncIterator[None]:
        auditor = app[RUNTIME].auditor
        yield
        if auditor is not None:
            await auditor.close()

    async def scheduler_ctx(self, app: web.Application) -> AsyncIterator[None]:
        scheduler = app[RUNTIME].scheduler
        if scheduler is not None:
            scheduler.start()
        yield
        if scheduler is not None:
            await scheduler.close()

    async def triage_ctx(self, app: web.Application) -> AsyncIterator[None]:
        triage = app[RUNTIME].triage
        if triage is not None:
            triage.start()
        yield
        if triage is not None:
            await triage.close()

    async def invariance_ctx(self, app: web.Application) -> AsyncIterator[None]:
        check = app[RUNTIME].invariance
        worker = app.get(WORKER)
        if check is not None and worker is not None and worker.index != 0:
            check.state = "in_worker_0"  # one check per server: N at once would batch each other
        elif check is not None:
            check.start()
        yield
        if check is not None:
            await check.close()

    async def fingerprint_ctx(self, app: web.Application) -> AsyncIterator[None]:
        poller = app[RUNTIME].fingerprint
        tasks = TaskOwner("app")
        if poller is not None:
            tasks.spawn(poller.run(), name="fingerprint")
        engine = app[RUNTIME].engine
        if engine is not None and engine.follower is not None:
            tasks.spawn(engine.follower.run(), name="engine-log")
        yield
        await tasks.close()

    async def tally_ctx(self, app: web.Application) -> AsyncIterator[None]:
        tasks = TaskOwner("app")
        if self.incidents.on_disk:
            every_s = self.settings.incidents.tally_interval_s
            tasks.spawn(_write_tallies(self.incidents, self.tally, every_s), name="tally")
        yield
        await tasks.close()

    async def budget_sync_ctx(self, app: web.Application) -> AsyncIterator[None]:
        loops = self.settings.loops
        tasks = TaskOwner("app")
        sync: RedisBudgetSync | FolderBudgetSync | None = None
        if loops.enabled and loops.recovery_budget_store == "redis":
            from proxy.loops.budget_sync import RedisBudgetSync  # the optional `redis` extra

            redis_sync = RedisBudgetSync(
                loops.recovery_budget_redis_url, self.budget, self.bus, loops.recovery_budget_sync_s
            )
            tasks.spawn(redis_sync.run(), name="recovery-budget-sync")
            sync = redis_sync
        elif loops.enabled and self.fleet_dir is not None:
            # --workers: one budget for the server, as one process had (not a floor split N ways)
            folder_sync = FolderBudgetSync(
                self.fleet_dir, self.budget, loops.recovery_budget_sync_s
            )
            tasks.spawn(folder_sync.run(), name="recovery-budget-workers")
            sync = folder_sync
        app[BUDGET_SYNC] = sync
        yield
        await tasks.close()
        if sync is not None:
            await sync.close()


async def _health(request: AdminRequest) -> Reply:
    return json_reply({"status": "ok"})


def _budget_store_status(sync: RedisBudgetSync | FolderBudgetSync | None) -> dict[str, object]:
    return {"store": "memory"} if sync is None else sync.status()


def _publishing(view: ServerView, fleet: Fleet) -> Callable[[web.Application], AsyncIterator[None]]:
    """A worker's cleanup context: its figures published while it runs, and once more at its
    stop (proxy/observe/fleet.py)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        worker = app.get(WORKER)
        index = worker.index if worker is not None else 0

        def status() -> dict[str, Any]:
            return view.published(index, _own_status(app, config=False))

        def ring() -> list[dict[str, Any]]:
            return view.incidents.recent(10**9)

        tasks = TaskOwner("app")
        tasks.spawn(fleet.run(status, ring, lambda: view.incidents.changes), name="publish")
        yield
        await tasks.close()
        fleet.publish_last(status(), ring())

    return ctx


async def _status(app: web.Application, view: ServerView) -> Reply:
    """This worker's status, under --workers the others' added (proxy/observe/merge.py)."""
    return json_reply(view.status(_own_status(app)))


def _own_status(app: web.Application, config: bool = True) -> dict[str, Any]:
    settings = app[SETTINGS]
    return (
        {
            "version": __version__,
            "worker": worker_status(app),  # which process answered (serve --workers N)
            "upstream": mask_url(settings.upstream.url),
            "uptime_s": round(time.time() - app[STARTED_AT], 3),
            "event_loop": loop_name(asyncio.get_running_loop()),
            "inflight": app[RUNTIME].forwarder.inflight,
            "tasks": len(asyncio.all_tasks()),
            "audit": app[TALLY].snapshot(),
            "shadow": _shadow_status(app[RUNTIME].scheduler),
            "causes": app[TALLY].causes_by_model(),
            "triage": _triage_status(app[RUNTIME].triage),
            "upstream_fingerprint": _fingerprint_status(app[RUNTIME].fingerprint),
            "upstream_state": _upstream_state(app[RUNTIME].fingerprint),
            "engine": _engine_status(app[RUNTIME].engine),
            "passive_pending": _passive_pending(app[RUNTIME].auditor),
            "injection": app[RUNTIME].forwarder.guard.snapshot(),
            "recovery_budget": app[RUNTIME].recovery_budget.snapshot(),
            "recovery_budget_store": _budget_store_status(app[BUDGET_SYNC]),
            "incidents": {
                "recorded": len(app[INCIDENTS].recent(10**9)),
                **app[INCIDENTS].file_status(),  # written, queued, dropped (queue full)
            },
        }
    ) | ({"config": mask_secrets(settings.model_dump(mode="json"))} if config else {})


async def _write_tallies(incidents: IncidentLog, tally: AuditTally, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        incidents.write(tally.summary())


def _fingerprint_status(poller: FingerprintPoller | None) -> dict[str, Any] | None:
    fp = poller.current if poller is not None else None
    if fp is None:
        return None
    return fp.summary() | {
        "identity": dict(fp.identity),
        "load": dict(fp.load),
        "read_at": fp.read_at,
    }


def _upstream_state(poller: FingerprintPoller | None) -> dict[str, Any] | None:
    """up | down | waiting (not up yet since detproxy started) | unknown (not read yet),
    since when, why, and the changes and restarts counted; None without a poller."""
    return poller.state() if poller is not None else None


def _engine_status(engine: EngineTruth | None) -> dict[str, Any] | None:
    """What the engine says it loaded, what was declared of it that it does not meet."""
    return engine.status() if engine is not None else None


def _triage_status(triage: Triage | None) -> dict[str, Any] | None:
    return triage.status() if triage is not None else None


def _passive_pending(auditor: Auditor | None) -> int:
    return auditor.pending if auditor is not None else 0


def _shadow_status(scheduler: ShadowScheduler | None) -> dict[str, object] | None:
    if scheduler is None:
        return None
    return {
        "queued": scheduler.queued,
        "running": scheduler.running,
        "primary_tokens": scheduler.primary_tokens,
        "shadow_tokens": scheduler.shadow_tokens,
    }
