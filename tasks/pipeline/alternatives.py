"""The chosen plan beside the plans people would otherwise pick, priced by the same model:
the paper's heuristic, the fastest type alone, the slowest type alone, and all on-demand."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from tasks.core.errors import UserInputError
from tasks.planner import PlanRequest, solve_problem
from tasks.planner.problem import build_problem


def _homogeneous(request: PlanRequest, type_name: str) -> PlanRequest:
    quota = {t: (request.quota.get(t, request.profile.instance(t).quota) if t == type_name else 0)
             for t in request.profile.type_names}
    existing = {t: n for t, n in request.existing.items() if t == type_name}
    return replace(request, quota=quota, existing=existing)


def plan_alternatives(request: PlanRequest) -> list[dict]:
    """Rows of {name, plan, predicted_time_s, predicted_cost_usd, status}; infeasible
    alternatives say so instead of disappearing (that is part of the story)."""
    model_alone_s = build_problem(request).model.iteration_times_s(np.array(1.0))
    names = request.profile.type_names
    fastest = names[int(np.argmin(model_alone_s))]
    slowest = names[int(np.argmax(model_alone_s))]
    variants = [
        ("chosen (exact)", replace(request, solver="exact")),
        ("paper heuristic", replace(request, solver="heuristic")),
        (f"homogeneous fast ({fastest})", _homogeneous(replace(request, solver="exact"), fastest)),
        (f"homogeneous slow ({slowest})", _homogeneous(replace(request, solver="exact"), slowest)),
        ("all on-demand", replace(request, solver="exact", on_demand=True)),
    ]
    rows = []
    for name, req in variants:
        try:
            result = solve_problem(build_problem(req))
        except UserInputError as err:  # one type's quota below the request's min_workers
            rows.append({"name": name, "status": "infeasible", "plan": {}, "predicted_time_s": None,
                         "predicted_cost_usd": None, "fastest_time_s": None, "message": str(err)})
            continue
        rows.append({
            "name": name, "status": result.status, "plan": result.plan,
            "predicted_time_s": result.predicted_time_s if result.feasible else None,
            "predicted_cost_usd": result.predicted_cost_usd if result.feasible else None,
            "fastest_time_s": result.fastest_time_s,
        })
    return rows
