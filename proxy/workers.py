"""``detproxy serve --workers N``: N serving processes on one port, and the supervisor over them.

Each worker is a whole ``detproxy serve`` (its own event loop, upstream pool, shadow scheduler)
listening with ``SO_REUSEPORT`` on the same address, so the kernel spreads connections across
them. The supervisor binds the port first (a port in use fails at once, and port 0 is resolved
to one port for all), starts the workers, restarts one that dies (logged, counted in
``detproxy_worker_restarts_total``, backing off when it dies young) and, on SIGTERM or SIGINT,
passes the signal to every worker and waits for them to drain (``server.shutdown_grace_s``).
The shadow rate limit and the recovery token floor are split across the workers
(``worker_budgets``); concurrent shadows and triage experiments take turns on the engine through
``flock``s in the folder the workers share (``proxy.audit.turns``); the memory duplicate store
is each worker's own (Redis shares it); every worker appends whole lines to the same incident
log, under a lock that makes its rotation one process's (proxy/observe/incident_file.py).

Metrics: the workers run prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
a fresh directory per supervisor), so ``/detproxy/metrics``, whichever worker answers it, is
the sum over the workers, dead ones included for counters and histograms: one scrape target
per server, as with gunicorn. ``/detproxy/status``, ``/detproxy/incidents`` and the explorer
are the answering worker's own figures with every other worker's added, as each publishes
them in the same directory (proxy/observe/fleet.py, merged by proxy/observe/merge.py);
``status.worker`` says which one answered, ``status.workers`` each one's own figures.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
from aiohttp import web

from proxy.config import Settings
from proxy.cores import usable_cores
from proxy.observe.fleet import stale_files
from proxy.tasks import TaskOwner

log = logging.getLogger("detproxy.workers")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STATE_FILE = "supervisor.json"  # in the metrics directory: what the workers export of it
YOUNG_S = 5.0  # a worker that dies sooner than this after its start is restarted after a delay
MAX_DELAY_S = 10.0


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    index: int
    count: int


WORKER = web.AppKey("worker", WorkerIdentity)


def worker_status(app: web.Application) -> dict[str, int]:
    """``status.worker``: which process answered (the only one without ``--workers``)."""
    identity = app.get(WORKER) or WorkerIdentity(0, 1)
    return {"index": identity.index, "of": identity.count, "pid": os.getpid()}


def resolve_workers(settings: Settings, cores: Callable[[], int] = usable_cores) -> Settings:
    """``settings`` with ``server.workers`` a number: "auto" is one per core this process may
    use (``proxy.cores.usable_cores``)."""
    server = settings.server
    if server.workers != "auto":
        return settings
    resolved = server.model_copy(update={"workers": cores()})
    return settings.model_copy(update={"server": resolved})


def worker_budgets(settings: Settings, count: int) -> dict[str, str]:
    """Environment overrides that split the server's budgets across ``count`` workers, so that
    together they hold to what the configuration says: shadows per second. (Shares,
    ``max_token_share``, hold per worker as they do for the whole.) A worker whose
    clients are busier than the others' reaches its part sooner: the whole stays under the
    limit, never over it. The audit's token allowance is split too, and its floor (one audit
    per model every ``at_least_every_s``) stretched by ``count``: together, about one."""
    audit = settings.audit
    # Concurrent shadows are not split: every worker's shadow takes one of the server's
    # max_concurrent_shadows turns in the folder they share (proxy/audit/turns.py).
    split = {
        "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": repr(audit.max_shadows_per_s / count),
        "DETPROXY_AUDIT__TOKEN_ALLOWANCE": str(audit.token_allowance // count),
        "DETPROXY_AUDIT__AT_LEAST_EVERY_S": repr(audit.at_least_every_s * count),
        # Triage is not split: its rate and tokens are one ledger in the workers' shared folder
        # (proxy/attribution/account.py), its experiments one at a time (proxy/audit/turns.py).
    }
    # The recovery budget is not split either: the workers add each other's totals through
    # their shared folder (proxy/loops/budget_folder.py), or Redis shares it across replicas.
    # Split, a 1/N floor could hold less than one retry of max_tokens.
    return split


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    young_deaths: int = 0  # in a row
    restart_at: float | None = None


class Supervisor:
    """Starts ``count`` workers with ``argv + ["--worker-index", i]`` and keeps them running."""

    def __init__(
        self,
        argv: Sequence[str],
        count: int,
        grace_s: float,
        env: dict[str, str] | None = None,
        poll_s: float = 0.1,
        exit_margin_s: float = 5.0,  # after the grace: a worker's cleanup, then its exit
    ) -> None:
        self._argv = list(argv)
        self._workers = [_Worker(i) for i in range(count)]
        self._grace_s = grace_s
        self._env = dict(os.environ if env is None else env)
        self._poll_s = poll_s
        self._exit_margin_s = exit_margin_s
        self._stop_signal: int | None = None
        self._metrics_dir: Path | None = None
        self._own_dir = False

    # -- metrics directory ------------------------------------------------------------------

    def _prepare_metrics_dir(self) -> Path:
        given = self._env.get(MULTIPROC_ENV)
        if given:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
            for stale in [*path.glob("*.db"), *stale_files(path)]:  # else summed in
                stale.unlink()
        else:
            path = Path(tempfile.mkdtemp(prefix="detproxy-metrics-"))
            self._own_dir = True
        self._env[MULTIPROC_ENV] = str(path)
        return path

    def _write_state(self) -> None:
        if self._metrics_dir is None:
            return
        state = {
            "workers": len(self._workers),
            "restarts": {str(w.index): w.restarts for w in self._workers},
            # The running workers (proxy/observe/merge.py: an exited one's gauges leave the sums).
            "pids": {str(w.index): w.proc.pid for w in self._workers if w.proc is not None},
        }
        tmp = self._metrics_dir / (STATE_FILE + ".tmp")
        tmp.write_bytes(orjson.dumps(state))
        tmp.replace(self._metrics_dir / STATE_FILE)  # readers see the old file or the new one

    def _worker_gone(self, pid: int) -> None:
        if self._metrics_dir is not None:
            from prometheus_client import multiprocess  # its live gauges leave the sums

            multiprocess.mark_process_dead(pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]

    # -- processes --------------------------------------------------------------------------

    def _spawn(self, worker: _Worker) -> None:
        argv = [*self._argv, "--worker-index", str(worker.index)]
        # Its own process group: a Ctrl-C reaches the supervisor, which passes it on once.
        worker.proc = subprocess.Popen(
            argv, env=self._env, stdin=subprocess.DEVNULL, process_group=0
        )
        worker.started = time.monotonic()
        worker.restart_at = None
        self._write_state()
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)

    def _on_exit(self, worker: _Worker, now: float) -> None:
        assert worker.proc is not None
        pid, code = worker.proc.pid, worker.proc.returncode
        self._worker_gone(pid)
        worker.proc = None
        worker.restarts += 1
        young = now - worker.started < YOUNG_S
        worker.young_deaths = worker.young_deaths + 1 if young else 0
        delay = min(0.1 * 2**worker.young_deaths, MAX_DELAY_S) if young else 0.0
        worker.restart_at = now + delay
        self._write_state()
        log.error(
            "worker %d (pid %d) exited with %s; restarting it in %.1fs (restart %d)",
            worker.index,
            pid,
            _describe_exit(code),
            delay,
            worker.restarts,
        )

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        self.stop(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """What SIGTERM or SIGINT does: ``signum`` is passed on to the workers."""
        self._stop_signal = signum

    def live(self) -> Iterator[subprocess.Popen[bytes]]:
        return (w.proc for w in self._workers if w.proc is not None and w.proc.poll() is None)

    def run(self) -> int:
        """Until SIGTERM or SIGINT; then every worker gets it and its grace to drain."""
        previous = {
            sig: signal.signal(sig, self._signalled) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        self._metrics_dir = self._prepare_metrics_dir()
        try:
            self._write_state()
            for worker in self._workers:
                self._spawn(worker)
            while self._stop_signal is None:
                now = time.monotonic()
                for worker in self._workers:
                    if worker.proc is not None and worker.proc.poll() is not None:
                        self._on_exit(worker, now)
                    due = worker.restart_at
                    if worker.proc is None and due is not None and now >= due:
                        self._spawn(worker)
                time.sleep(self._poll_s)
            return self._drain(self._stop_signal)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._own_dir and self._metrics_dir is not None:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _drain(self, signum: int) -> int:
        procs = list(self.live())
        log.info(
            "%s: stopping %d worker(s), %.0fs to drain",
            signal.Signals(signum).name,
            len(procs),
            self._grace_s,
        )
        for proc in procs:
            proc.send_signal(signum)
        deadline = time.monotonic() + self._grace_s + self._exit_margin_s
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop within its grace; killed", proc.pid)
                proc.kill()
                proc.wait()
        log.info("stopped: %d worker(s) exited", len(procs))
        return 0


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def watch_supervisor(supervisor_pid: int, every_s: float = 1.0) -> Any:
    """A ``cleanup_ctx`` for a worker: when its supervisor is gone (killed outright, so it
    could not pass SIGTERM on), the worker stops itself gracefully instead of serving on."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        tasks = TaskOwner("worker")
        tasks.spawn(_watch(supervisor_pid, every_s), name="watch-supervisor")
        yield
        await tasks.close()

    return ctx


async def _watch(supervisor_pid: int, every_s: float) -> None:
    # Polled: no event tells a process that its parent died (short of prctl).
    while os.getppid() == supervisor_pid:  # noqa: ASYNC110
        await asyncio.sleep(every_s)
    log.error("supervisor (pid %d) is gone: stopping this worker", supervisor_pid)
    os.kill(os.getpid(), signal.SIGTERM)  # the graceful shutdown, as for an operator's


def supervisor_state() -> dict[str, Any] | None:
    """What the supervisor last wrote (None outside ``--workers``)."""
    directory = os.environ.get(MULTIPROC_ENV)
    if not directory:
        return None
    try:
        state: dict[str, Any] = orjson.loads((Path(directory) / STATE_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return state


def live_worker_pids() -> set[int] | None:
    """The pids of the workers the supervisor runs now (None outside ``--workers``, or not
    known)."""
    state = supervisor_state()
    pids = state.get("pids") if state is not None else None
    if not isinstance(pids, dict):
        return None
    return {int(pid) for pid in pids.values()}
