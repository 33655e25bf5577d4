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


class NodeLoss:
    """A lost node reported by the node watch's thread, read by the main thread at known points only
    (:func:`check_node_lost`: the supervisor's wait loop, between the executor's steps, the SSH wait, and the end
    of the watch when the job is failing anyway); never raised into whatever the main thread was doing (a ledger
    write, a staging copy)."""

    def __init__(self, hint: str):
        self.event = threading.Event()
        self.message: str | None = None
        self.hint = hint
        self.delivered = False
        self._lock = threading.Lock()

    def post(self, message: str) -> None:
        with self._lock:
            if self.message is None:
                self.message = message
        self.event.set()

    def take(self) -> "NodeLost | None":
        """The NodeLost to raise, once (None when nothing was lost or it was raised already)."""
        with self._lock:
            if self.message is None or self.delivered:
                return None
            self.delivered = True
            return NodeLost(self.message, hint=self.hint)


#: the node watches of the jobs running in this process (innermost last)
_WATCHES: list[NodeLoss] = []


def check_node_lost() -> None:
    """Raise :class:`NodeLost` when a node watch has reported a lost node since the last check: the one point where
    the main thread learns of it (cheap: a flag read)."""
    for w in list(_WATCHES):
        if w.event.is_set():
            lost = w.take()
            if lost is not None:
                raise lost


def watch_nodes(ledger: "Ledger", run: Run, providers: dict[str, Provider] | None, ctx: Context, *,
                interval_s: float) -> "contextlib.AbstractContextManager[None]":
    """A context for the job's duration: a thread describes every live instance of ``run`` each ``interval_s``
    seconds; one that the provider shows ``stopped`` / ``failed`` / ``terminated`` gets that state and why on its
    ledger row (``attrs["provider_state"]``, ``error``: ``broker status`` shows it) and the job is ended at once
    instead of waiting for SSH to time out while the other nodes bill: the loss is posted as an event
    (:class:`NodeLoss`) that the supervisor's wait loop reads (:func:`check_node_lost`, raising :class:`NodeLost`
    there); a step that fails while a loss is posted ends with NodeLost too.  Describe errors are ignored (the next
    pass looks again).  Outside the main thread: nothing."""
    if threading.current_thread() is not threading.main_thread() or interval_s <= 0:
        return contextlib.nullcontext()

    @contextmanager
    def watching() -> Iterator[None]:
        stop = threading.Event()
        loss = NodeLoss(hint=f"`broker status {run.id}` shows the node; the run is torn down")

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
                    loss.post(msg)  # first: the job ends even when the ledger cannot take the line below
                    try:
                        ledger.update_resource(res.id, error=msg, attrs={"provider_state": info.state},
                                               actor=ctx.actor, message=msg)
                    except Exception:  # noqa: BLE001 - the loss is posted; the row is written by teardown
                        pass
                    ctx.say(msg)
                    return

        t = threading.Thread(target=loop, name=f"watch-nodes-{run.id}", daemon=True)
        _WATCHES.append(loss)
        t.start()
        try:
            yield
        except NodeLost:
            raise
        except Exception as e:
            # a step that failed while a node was lost (an SSH wait, a copy): the loss is why
            lost = loss.take() if loss.event.is_set() else None
            if lost is not None:
                raise lost from e
            raise
        finally:
            stop.set()
            _WATCHES.remove(loss)
            t.join(timeout=interval_s + 30)

    return watching()
