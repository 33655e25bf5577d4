"""The planner's ranked valid options on one provider, as the tests ask for them (the pipeline plans across
providers in :func:`broker.run.planstep.plan_for_run`)."""

from __future__ import annotations

from broker.core.model import PlanOption, Requirements, utcnow
from broker.core.provider import Provider


def rank_options(provider: Provider, req: Requirements) -> list[PlanOption]:
    """The valid plan options on one provider, ranked by the planner (:func:`broker.plan.planner.plan`) from the
    provider's offers, quotas and capacity."""
    from broker.plan.planner import plan

    offers = provider.offers(req)
    p = plan(req, offers, provider.quotas(req, offers), provider.capacity(offers), now=utcnow())
    return [o for o in p.options if o.valid]
