"""What guards a running job: :func:`shielded` release (a Ctrl-C during teardown says what is still being
released; a second one within the window abandons it) and :func:`watch_nodes`, which notices a node the provider
lost while the job runs.
"""

from __future__ import annotations

import signal
import threading
import time
import contextlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from broker.core.records import Run
from broker.core.provider import BrokerError, Provider
from broker.run.runrecord import Context, Say

if TYPE_CHECKING:
    from broker.money.ledger import Ledger


# --------------------------------------------------------------------------------------------------- the pipeline
@contextmanager
def shielded(say: Say | None, *, window_s: float = 2.0) -> Iterator[None]:
    """Shield a release from Ctrl-C: the first Ctrl-C says teardown is still running; a second one within
    ``window_s`` seconds abandons it (raises KeyboardInterrupt; the watchdog / ``broker down`` finish).  Only in the
    main thread (signal handlers live there); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    last = [0.0]

    def handler(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if now - last[0] <= window_s:
            if say:
                say("teardown abandoned: the watchdog (or `broker down RUN`) finishes it; every resource is in the "
                    "ledger")
            raise KeyboardInterrupt
        last[0] = now
        if say:
            say(f"still releasing resources (teardown); press Ctrl-C again within {window_s:g} s to abandon it and "
                "leave the rest to the watchdog")

    def hold(signum: int, frame: Any) -> None:
        # SIGTERM / SIGHUP while tearing down (`timeout` sends TERM again, the closed terminal HUP): the teardown
        # they asked for is running; only a second Ctrl-C abandons it
        if say:
            try:
                say(f"{signal.Signals(signum).name} received: still releasing resources (teardown); broker exits "
                    "when it is done")
            except (OSError, ValueError, SystemExit):  # the terminal is gone (SIGHUP): say nothing
                pass

    old = signal.signal(signal.SIGINT, handler)
    olds = {sig: signal.signal(sig, hold) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        for sig, h in olds.items():
            signal.signal(sig, h)


#: seconds between the describes of a cloud run's nodes while its job runs (CloudTarget ``monitor_s``)
MONITOR_S = 30.0


class NodeLost(BrokerError):
    """A node the job runs on was stopped, failed or disappeared at the provider while the job ran (exit 1)."""

    exit_code = 1


def watch_nodes(ledger: "Ledger", run: Run, providers: dict[str, Provider] | None, ctx: Context, *,
                interval_s: float) -> "contextlib.AbstractContextManager[None]":
    """A context for the job's duration: a thread describes every live instance of ``run`` each ``interval_s``
    seconds; one that the provider shows ``stopped`` / ``failed`` / ``terminated`` gets that state and why on its
    ledger row (``attrs["provider_state"]``, ``error``: ``broker status`` shows it) and the job is ended at once
    (:class:`NodeLost` raised in the main thread through SIGUSR2), instead of waiting for SSH to time out while the
    other nodes bill.  Describe errors are ignored (the next pass looks again).  Outside the main thread: nothing."""
    import _thread

    if threading.current_thread() is not threading.main_thread() or interval_s <= 0:
        return contextlib.nullcontext()

    @contextmanager
    def watching() -> Iterator[None]:
        stop = threading.Event()
        lost: list[str] = []

        def on_lost(signum: int, frame: Any) -> None:
            if lost and not stop.is_set():
                raise NodeLost(lost[0], hint=f"`broker status {run.id}` shows the node; the run is torn down")

        def loop() -> None:
            from broker.providers import get_provider

            cache: dict[str, Provider] = dict(providers or {})
            while not stop.wait(interval_s):
                for res in ledger.resources(run.id, live_only=True):
                    if res.kind != "instance" or not res.provider_id or res.state in ("terminating", "terminated"):
                        continue
                    try:
                        p = cache.get(res.provider) or cache.setdefault(res.provider, get_provider(res.provider))
                        info = p.describe_instance(res.provider_id, region=res.region)
                    except Exception:  # noqa: BLE001 - a failed describe proves nothing: the next pass looks again
                        continue
                    if info.state not in ("stopped", "failed", "terminated") or stop.is_set():
                        continue
                    raw = info.raw_state or info.state
                    msg = (f"node {res.attrs.get('node_index', '?')} ({res.provider} {res.provider_id}) became {raw} "
                           "at the provider while the job ran"
                           + (f" ({info.message})" if info.message else "")
                           + ("; it may still bill its disk" if info.state == "stopped" else "")
                           + ": ended the job")
                    ledger.update_resource(res.id, error=msg, attrs={"provider_state": info.state},
                                           actor=ctx.actor, message=msg)
                    lost.append(msg)
                    ctx.say(msg)
                    _thread.interrupt_main(signal.SIGUSR2)
                    return

        old = signal.signal(signal.SIGUSR2, on_lost)
        t = threading.Thread(target=loop, name=f"watch-nodes-{run.id}", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=interval_s + 30)
            signal.signal(signal.SIGUSR2, old)

    return watching()
