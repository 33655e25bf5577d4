"""``broker quota check|request|status``: GPU quota (service limits) on OCI and AWS, in plain words.

Limits are read through the adapters' ``quotas()``; the logic (which limit covers a type, units, verdicts) lives
in :mod:`broker.plan.quota`.  Requests go through the adapters' ``request_quota()`` and are recorded in the ledger.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Optional

import typer

from broker import providers as _registry

if TYPE_CHECKING:
    from broker.core.model import Offer, Quota
    from broker.core.provider import Provider
    from broker.plan.quota import Need

#: Providers with readable / requestable GPU limits: the adapters with the ``quota`` capability.
QUOTA_PROVIDERS = _registry.QUOTA
#: Request states after which nothing changes any more (OCI and AWS words).
FINAL_STATES = {"APPROVED", "DENIED", "CASE_CLOSED", "NOT_APPROVED", "INVALID_REQUEST", "SUCCEEDED",
                "PARTIALLY_SUCCEEDED", "CANCELED", "FAILED", "DRAFT"}


def _scope_kind(provider: str) -> str | None:
    """Where ``provider``'s GPU limits are counted: ``"AD"``, ``"region"`` (its ``quota_scope`` capability)."""
    return _registry.capability(provider, "quota_scope")


class ProviderUnavailable(Exception):
    """The adapter module for a provider is not part of this install."""


def provider_factory(name: str, region: str | None = None) -> "Provider":
    """The adapter for ``name`` (``region`` passed when the adapter takes one).  Raises ProviderUnavailable when
    its module (or SDK) is missing.  Tests replace this function."""
    import broker.providers as providers

    try:
        cls = providers.provider_class(name)
    except (ImportError, AttributeError) as e:
        raise ProviderUnavailable(f"{name}: provider not available in this install ({e})") from None
    if region:
        try:
            return cls(region=region)
        except TypeError:
            pass
    return cls()


def _job(nodes: int, gpus_per_node: int, topology: str, recipe: Optional[str]) -> tuple[int, int, str]:
    if recipe:
        from broker.core.recipe import load_recipe

        r = load_recipe(recipe)
        return r.nodes, r.gpus_per_node, r.topology
    return nodes, gpus_per_node, topology


def _needs(provider: str, nodes: int, gpus_per_node: int, instance_type: Optional[str], topology: str,
           spot: bool = False) -> list["Need"]:
    from broker.core.provider import BadInput
    from broker.plan.quota import instance_specs, needs_for

    try:
        needs = needs_for(provider, nodes, gpus_per_node, instance_type=instance_type, topology=topology, spot=spot)
    except KeyError as e:
        raise BadInput(str(e.args[0]), hint="`--instance-type` takes a type / shape from the snapshot") from None
    if instance_type and not needs:
        spec = instance_specs(provider)[instance_type]
        raise BadInput(f"{instance_type} ({spec.gpus} GPU) fits neither topology of {nodes} node(s) x "
                       f"{gpus_per_node} GPU", hint="lower --gpus-per-node or choose a larger type")
    return needs


def _offers_for(prov: "Provider", provider: str, req: Any, needs: list["Need"], region: Optional[str],
                spot: bool = False) -> list["Offer"]:
    """The adapter's offers for the needed types; synthesized from the snapshot when the adapter lists none."""
    from broker.core.model import Offer
    from broker.core.provider import ProviderError

    want = {n.spec.instance_type for n in needs}
    try:
        offers = [o for o in prov.offers(req) if o.instance_type in want]
    except ProviderError:  # the limits may still be readable: describe the types from the snapshot
        offers = []
    have = {o.instance_type for o in offers}
    for n in needs:
        s = n.spec
        if s.instance_type in have:
            continue
        have.add(s.instance_type)
        offers.append(Offer(provider=provider, offer_id=s.instance_type, instance_type=s.instance_type,
                            region=region or (None if s.region == "any" else s.region), gpu_name=s.gpu_name,
                            gpu_count=s.gpus, gpu_mem_gib=s.gpu_mem_gib, vcpus=s.vcpus, ram_gib=s.ram_gib,
                            usd_per_hour=s.usd_per_hour, private_network=True, price_source=s.source,
                            price_time=s.price_time))
    if spot:  # adapters pick the spot quota for offers marked so (AWS L-3819A6DF, L-7212CCBC / L-C4BD4855 for P5)
        offers = [replace(o, attrs={**o.attrs, "market": "spot"}) for o in offers]
    return offers


def check_provider(provider: str, nodes: int, gpus_per_node: int, instance_type: Optional[str], topology: str,
                   region: Optional[str], spot: bool = False) -> dict[str, Any]:
    """Everything ``broker quota check`` shows for one provider, as data (also the ``--json`` output)."""
    from broker.core.model import Requirements
    from broker.core.provider import ProviderError
    from broker.plan.quota import explain_usage, instance_specs, request_command, verdict

    out: dict[str, Any] = {"provider": provider, "available": True, "configured": None, "quotas": [],
                           "verdicts": [], "explanations": [], "error": None}
    try:
        prov = provider_factory(provider, region)
    except ProviderUnavailable as e:
        out.update(available=False, error=str(e))
        return out
    needs = _needs(provider, nodes, gpus_per_node, instance_type, topology, spot)
    chk = prov.check()
    out["configured"] = chk.configured
    if not chk.configured:
        out["error"] = f"not configured: {chk.detail}" + (f"; {chk.hint}" if chk.hint else "")
    quotas: list["Quota"] = []
    if chk.configured:
        req = Requirements(nodes=nodes, gpus_per_node=gpus_per_node, min_gpu_mem_gib=0, hours=None, budget_usd=None,
                           topology=topology if topology in ("simulated", "multi-node") else "any",
                           providers=[provider])
        try:
            quotas = prov.quotas(req, _offers_for(prov, provider, req, needs, region, spot))
        except ProviderError as e:
            out["error"] = str(e)
    out["quotas"] = [asdict(q) | {"available": q.available} for q in quotas]
    specs = instance_specs(provider)
    read = {q.name for q in quotas}
    unread = sorted({n.limit.name for n in needs if n.limit.name not in read})
    if read and unread:
        out["not_reported"] = unread  # the adapter returned no value for these limits
        needs = [n for n in needs if n.limit.name in read]
    for n in needs:
        v = verdict(n, quotas)
        row = {"topology": n.topology, "instance_type": n.spec.instance_type, "instances": n.instances,
               "limit": n.limit.name, "unit": n.limit.unit, "units_needed": n.units, "ok": v.ok, "scope": v.scope,
               "sentence": v.sentence, "next_step": None}
        if not v.ok and v.request_value is not None:
            row["next_step"] = request_command(provider, n.limit.name, v.request_value, scope=v.scope,
                                               region=None if n.limit.scope_kind == "account"
                                               else region or (quotas[0].region if quotas else None))
        out["verdicts"].append(row)
    for q in quotas:
        spec = next((specs[t] for t in q.instance_types if t in specs), None)
        out["explanations"].append(explain_usage(q, spec))
    return out


def _print_check(res: dict[str, Any]) -> None:
    from rich.table import Table

    from broker.core.ui import console

    p = res["provider"]
    if not res["available"]:
        console.print(res["error"], markup=False)
        return
    if res["error"]:
        console.print(f"{p}: limits not read: {res['error']}", markup=False)
    if res["quotas"]:
        t = Table(title=f"{p} GPU limits", title_justify="left")
        for col in ("limit", "scope", "unit", "limit value", "used", "available", "covers", "source"):
            t.add_column(col, overflow="fold")
        for q in res["quotas"]:
            t.add_row(q["name"], str(q["scope"] or q["region"] or "-"), q["unit"], f"{q['limit']:g}", f"{q['used']:g}",
                      f"{q['available']:g}", ", ".join(q["instance_types"]), q["source"] or "-")
        console.print(t)
    if res["verdicts"] and not res["configured"]:
        console.print(f"{p}: what each option needs (your limits are unknown until {p} is configured):",
                      markup=False)
    for v in res["verdicts"]:
        mark = "OK " if v["ok"] else (" ? " if v["ok"] is None or not res["configured"] else "NO ")
        console.print(f"{mark} {v['topology']}: {v['sentence']}", markup=False)
        if v["next_step"]:
            console.print(f"    -> {v['next_step']}", markup=False)
    for e in res["explanations"]:
        console.print(f"    note: {e}", markup=False)
    if res.get("not_reported"):
        console.print(f"    (limits not reported by the {p} adapter: {', '.join(res['not_reported'])})", markup=False)


def _units_help() -> str:
    """What ``--value`` counts, per quota provider (its ``quota_unit``): "oci: GPUs; aws: vCPUs; ..."."""
    words = {"gpus": "GPUs", "vcpus": "vCPUs"}
    return "; ".join(f"{p}: {words.get(_registry.capability(p, 'quota_unit'), 'units')}" for p in QUOTA_PROVIDERS)


#: form fields whose value is a command to paste (the rest of a draft's fields are words for a web form)
_COMMAND_FIELDS = ("gcloud", "command", "cli")


def _printed_whole(field: str, value: str) -> bool:
    """Whether a draft form's ``field`` is a URL or a command: printed after the table, on a line of its own."""
    return value.startswith(("https://", "http://")) or field in _COMMAND_FIELDS


#: the quota providers as a list and as a choice, for help texts
_NAMES = ", ".join(QUOTA_PROVIDERS)
_EITHER = " or ".join(QUOTA_PROVIDERS)

#: ``broker quota``: its help names the quota providers (broker.cli.app.COMMAND_TABLE adds it)
quota_app = typer.Typer(help=f"Check, explain and request GPU quota (service limits) on {_NAMES}.",
                        short_help=f"Check, explain and request GPU quota ({_NAMES})", no_args_is_help=True)


@quota_app.command("check", short_help="The GPU limits that matter for the job, and a verdict")
def check_cmd(
    provider: Optional[str] = typer.Option(None, "--provider", "-p", help=f"{_EITHER} (default: all)"),
    region: Optional[str] = typer.Option(None, "--region", help="region (default: the provider's)"),
    nodes: int = typer.Option(2, "--nodes", min=1, help="nodes of the job"),
    gpus_per_node: int = typer.Option(1, "--gpus-per-node", min=1, help="GPUs per node"),
    instance_type: Optional[str] = typer.Option(None, "--instance-type", "-t",
                                                help="AWS instance type / OCI shape (default: cheapest fitting)"),
    topology: str = typer.Option("any", "--topology", help="simulated | multi-node | any"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="take nodes/GPUs/topology from a recipe"),
    spot: bool = typer.Option(False, "--spot", help="the spot quota (AWS L-3819A6DF, L-7212CCBC / L-C4BD4855 for P5), not on-demand"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """The GPU limits that matter for the job (limit, used, available, unit, scope) and a verdict per topology."""
    from broker.core.provider import BadInput
    from broker.core.ui import print_json

    if provider and provider not in QUOTA_PROVIDERS:
        raise BadInput(f"quota check supports {', '.join(QUOTA_PROVIDERS)}, not {provider!r} "
                       f"({_registry.why_not(provider, 'quota')})",
                       hint=f"{provider} has no service limits to read: what it can rent now is what it offers "
                            f"(`broker offers --provider {provider}`; `broker plan --provider {provider}` plans "
                            "on it)")
    n, g, topo = _job(nodes, gpus_per_node, topology, recipe)
    results = [check_provider(p, n, g, instance_type, topo, region, spot) for p in ([provider] if provider
                                                                              else QUOTA_PROVIDERS)]
    if as_json:
        print_json({"nodes": n, "gpus_per_node": g, "providers": results})
        return
    for r in results:
        _print_check(r)


@quota_app.command("request", short_help="File (or --draft print) a quota increase for the job")
def request_cmd(
    provider: str = typer.Option(..., "--provider", "-p", help=_EITHER),
    value: Optional[float] = typer.Option(None, "--value",
                                          help=f"new limit ({_units_help()}); default: what the plan needs"),
    limit: Optional[str] = typer.Option(None, "--limit", help="the limit's name as `broker quota check` shows it"),
    scope: Optional[str] = typer.Option(None, "--scope", help="OCI availability domain"),
    region: Optional[str] = typer.Option(None, "--region"),
    reason: Optional[str] = typer.Option(None, "--reason", help="justification (default: a short DDP one)"),
    draft: bool = typer.Option(False, "--draft", help="print the filled-in console form, file nothing"),
    nodes: int = typer.Option(2, "--nodes", min=1),
    gpus_per_node: int = typer.Option(1, "--gpus-per-node", min=1),
    instance_type: Optional[str] = typer.Option(None, "--instance-type", "-t"),
    recipe: Optional[str] = typer.Option(None, "--recipe"),
    spot: bool = typer.Option(False, "--spot", help="the spot quota (AWS), not on-demand"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """File (or with --draft print) a quota increase sized for the job; recorded in the ledger."""
    from broker.core.ui import console, print_json

    n, g, topo = _job(nodes, gpus_per_node, "any", recipe)
    r, note = file_request(provider, value=value, limit=limit, scope=scope, region=region, reason=reason,
                           draft=draft, nodes=n, gpus_per_node=g, instance_type=instance_type, spot=spot)
    if as_json:
        print_json({"request": r, "note": note})
        return
    if note:
        console.print(note, markup=False)
    if r is None:
        return
    if r.state == "DRAFT":
        from rich.table import Table

        why = "--draft" if draft else f"{provider} is not configured"
        t = Table(title=f"quota increase form (not filed: {why})", title_justify="left", show_header=False)
        t.add_column("field", no_wrap=True)
        t.add_column("value", overflow="fold")
        whole = {}  # a URL or a command split across table rows cannot be clicked or pasted: after the table
        for k, v in r.form.items():
            if _printed_whole(k, str(v)):
                whole[k] = str(v)
            else:
                t.add_row(k, str(v))
        console.print(t)
        for k, v in whole.items():
            console.print(f"{k}:", markup=False, highlight=False)
            console.print(f"  {v}", markup=False, highlight=False, keep=[v])
        return
    console.print(f"{r.provider} {r.limit_name}"
                  + (f" ({r.scope})" if r.scope and r.scope != r.region else "")
                  + f" -> {r.value:g} {r.unit}: request {r.request_id or '-'} state {r.state}", markup=False)
    if r.message:
        console.print(f"  {r.message}", markup=False)
    console.print("  `broker quota status` refreshes the state.", markup=False)


@quota_app.command("status", short_help="Every quota request in the ledger, refreshed from the providers")
def status_cmd(
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    refresh: bool = typer.Option(True, "--refresh/--no-refresh", help="ask the providers for the current state"),
    provider: Optional[str] = typer.Option(None, "--provider", "-p", help=f"only this provider's requests ({_NAMES})"),
) -> None:
    """Every quota request in the ledger (or one provider's), refreshed from the providers."""
    from rich.table import Table

    from broker.core.provider import BadInput
    from broker.core.ui import console, print_json

    if provider is not None and provider not in QUOTA_PROVIDERS:
        raise BadInput(f"quota requests are filed for {', '.join(QUOTA_PROVIDERS)}, not {provider!r} "
                       f"({_registry.why_not(provider, 'quota')})",
                       hint="`broker quota status --provider oci` (or aws), or leave --provider out")
    rows = request_statuses(refresh=refresh, provider=provider)
    if as_json:
        print_json({"requests": rows})
        return
    if not rows:
        console.print("no quota requests recorded (`broker quota request` files one).")
        return
    t = Table(title="quota requests", title_justify="left")
    for col in ("id", "provider", "limit", "scope/region", "value", "unit", "request id", "state", "note"):
        t.add_column(col, overflow="fold", no_wrap=col == "state")
    for r in rows:
        t.add_row(r["id"], r["provider"], r["limit_name"], str(r.get("scope") or r.get("region") or "-"),
                  f"{r['requested_value']:g}", str(r.get("unit") or "-"), str(r.get("provider_request_id") or "-"),
                  str(r.get("state") or "-"), r.get("note") or "")
    console.print(t)


def file_request(provider: str, *, value: Optional[float], limit: Optional[str], scope: Optional[str],
                 region: Optional[str], reason: Optional[str], draft: bool, nodes: int, gpus_per_node: int,
                 instance_type: Optional[str], spot: bool = False) -> tuple[Any, str]:
    """Size, file (or draft) and record one request.  Returns (QuotaRequest or None, a note for the user)."""
    from broker.core.model import Quota, Requirements
    from broker.core.provider import BadInput, NotSupported, ProviderError
    from broker.plan.quota import default_reason, desired_value, verdict

    if provider not in QUOTA_PROVIDERS:
        raise BadInput(f"quota requests support {', '.join(QUOTA_PROVIDERS)}, not {provider!r} "
                       f"({_registry.why_not(provider, 'quota')})")
    try:
        prov = provider_factory(provider, region)
    except ProviderUnavailable as e:
        raise BadInput(str(e), hint="install broker with that provider's extra") from None
    chosen = _needs_of_limit(provider, _needs(provider, nodes, gpus_per_node, instance_type, "any", spot), limit,
                             instance_type, spot)
    note = ""
    quotas: list[Quota] = []
    chk = prov.check()
    if chk.configured:
        req = Requirements(nodes=nodes, gpus_per_node=gpus_per_node, min_gpu_mem_gib=0, hours=None, budget_usd=None,
                           providers=[provider])
        try:
            quotas = prov.quotas(req, _offers_for(prov, provider, req, chosen, region, spot))
        except ProviderError as e:
            if not draft:
                raise
            note = f"current limit not read ({e.message}); sizing from the job alone.\n"
    if scope:
        quotas = [q for q in quotas if q.scope == scope]
    # multi-node first (cheapest type first within it); prefer limits the provider reported; the first blocked one
    read = {q.name for q in quotas}
    ordered = sorted(chosen, key=lambda n: n.topology != "multi-node")
    candidates = [n for n in ordered if n.limit.name in read] or ordered
    judged = [(n, verdict(n, quotas)) for n in candidates]
    blocked = [(n, v) for n, v in judged if not v.ok]
    if value is None and read and not blocked:
        n, v = judged[0]
        return None, f"no increase needed: {v.sentence}"
    need, v = blocked[0] if blocked else judged[0]
    mine = [x for x in quotas if x.name == need.limit.name]
    q = next((x for x in mine if (x.scope or x.region) == v.scope), mine[0] if mine else None)
    if q is None:
        if need.limit.scope_kind == "region" and not region:
            # a regional limit's request names its region (GCP's per-project-region quota id carries the region
            # dimension): the adapter's region, else where the snapshot prices the type
            region = getattr(prov, "region", None) or (need.spec.region if need.spec.region != "any" else None)
        q = Quota(provider=provider, name=need.limit.name, description=need.limit.description,
                  region=region, scope=scope or (region if need.limit.scope_kind == "region" else None), limit=0,
                  used=0,
                  unit=need.limit.unit, instance_types=[need.spec.instance_type], source="not read")
    if _scope_kind(provider) == "AD" and not (scope or q.scope):
        if not draft:
            raise BadInput(f"{need.limit.name} is counted per availability domain: say which one with --scope",
                           hint="`broker quota check --provider oci` shows every AD's limit (with credentials); "
                                "the console shows the ADs under Governance > Limits, Quotas and Usage")
        q = replace(q, scope="<your availability domain, e.g. Uocm:US-ASHBURN-AD-1>")
        note += "fill in the availability domain you will launch in (the limit is counted per AD).\n"
    if _scope_kind(provider) == "AD" and not (region or q.region):  # the AD's region goes on the form
        from broker.core.config import settings

        q = replace(q, region=settings().oci_region or "<your region, e.g. us-ashburn-1>")
    target = float(value) if value is not None else desired_value(q if q.source != "not read" else None, need.units)
    from broker.plan.quota import check_request_value

    check_request_value(target, limit_name=need.limit.name, unit=need.limit.unit,
                        current=float(q.limit) if q.source != "not read" else None)
    why = reason or default_reason(nodes, gpus_per_node, need.spec.instance_type)
    note += (f"{need.instances}× {need.spec.instance_type} ({need.topology}) needs {need.units} "
             f"{need.limit.unit} of {need.limit.name}; requesting a limit of {target:g}")
    try:
        r = prov.request_quota(q, target, why, draft=draft)
    except NotSupported as e:
        raise BadInput(f"{provider}: quota requests are not supported by this adapter ({e.message})",
                       hint="use --draft and file it in the console") from None
    if draft:
        return r, note
    if r.state == "DRAFT":  # the adapter could not file it (no credentials): say so, and how to configure
        note += (f"\nnot filed: {provider} is not configured ({chk.detail})"
                 + (f"; {chk.hint}" if chk.hint else "") + f"; then run this again, or file the form below in "
                 "the console")
        return r, note
    _record_request(provider, r, why)
    return r, note


def _needs_of_limit(provider: str, needs: list["Need"], limit: Optional[str], instance_type: Optional[str],
                    spot: bool) -> list["Need"]:
    """The job's ``needs`` counted by the limit named ``limit`` (all of them when None).  Raises BadInput when that
    limit covers none of them (a misspelt name, or an instance type counted by another limit)."""
    from broker.core.provider import BadInput
    from broker.plan.quota import limit_for

    if not limit:
        return needs
    chosen = [n for n in needs if n.limit.name == limit]
    if not chosen and needs and instance_type is None:
        from broker.plan.quota import known_limits

        raise BadInput(f"no {provider} instance type in the snapshot is covered by limit {limit!r}",
                       hint=f"check the name; {provider}'s GPU limits: {', '.join(known_limits(provider))} "
                            f"(`broker quota check --provider {provider}` shows which the job needs)")
    if not chosen:
        ref = limit_for(provider, instance_type or "", spot=spot)
        raise BadInput(f"{instance_type} is covered by {ref.name if ref else 'no GPU limit'}, not {limit}")
    return chosen


def _record_request(provider: str, r: Any, why: str) -> None:
    """Write the filed request ``r`` (a QuotaRequest) to the ledger, or update its row when the provider answered
    with a request id the ledger holds already (a request filed again)."""
    from broker.money.ledger import Ledger

    with Ledger() as led:
        existing = next((row for row in led.quota_requests(provider)
                         if r.request_id and row.get("provider_request_id") == r.request_id), None)
        detail = {"message": r.message, "form": r.form}
        if existing:
            led.update_quota_request(existing["id"], state=r.state, detail=detail)
        else:
            led.add_quota_request(provider, r.limit_name, r.value, region=r.region, scope=r.scope, unit=r.unit,
                                  provider_request_id=r.request_id, state=r.state, reason=why, detail=detail)


def request_statuses(refresh: bool = True, provider: str | None = None) -> list[dict[str, Any]]:
    """Every ledger quota request (``provider``'s alone when given); open ones refreshed through the adapter
    (errors kept per row in ``note``)."""
    from broker.money.ledger import Ledger
    from broker.core.provider import BrokerError
    from broker.core.records import QuotaRequest

    out: list[dict[str, Any]] = []
    provs: dict[str, Any] = {}
    with Ledger() as led:
        for row in led.quota_requests(provider):
            row = dict(row)
            row["note"] = ""
            if refresh and row.get("provider_request_id") and (row.get("state") or "") not in FINAL_STATES:
                try:
                    if row["provider"] not in provs:
                        provs[row["provider"]] = provider_factory(row["provider"], row.get("region"))
                    qr = QuotaRequest(provider=row["provider"], limit_name=row["limit_name"], region=row.get("region"),
                                      scope=row.get("scope"), value=row["requested_value"],
                                      unit=row.get("unit") or "", request_id=row["provider_request_id"],
                                      state=row.get("state") or "PENDING", reason=row.get("reason") or "")
                    new = provs[row["provider"]].quota_request_status(qr)
                    if new.state != row.get("state"):
                        led.update_quota_request(row["id"], state=new.state,
                                                 detail={**(row.get("detail") or {}), "message": new.message})
                    row["state"] = new.state
                    row["note"] = new.message
                except ProviderUnavailable as e:
                    row["note"] = str(e)
                except BrokerError as e:
                    row["note"] = f"not refreshed: {e.message}"
            out.append(row)
    return out
