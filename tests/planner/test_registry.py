"""The solvers by name (tasks/planner/solvers.py): one table that the dispatch and every place
offering solver names read."""
import argparse
from typing import get_args

import pytest

from tasks.cli.main import build_parser
from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile
from tasks.pipeline.params import TrainRequest
from tasks.planner import PlanRequest, build_problem, solve
from tasks.planner.solvers import DEFAULT_SOLVER, SOLVERS, Solver, get_solver, register, solver_names
from tests.helpers import SHIPPED_PROFILE


def test_the_table_lists_the_solvers_in_order_and_the_risk_solver_alone_uses_hazards():
    assert solver_names() == ("exact", "heuristic", "risk") and DEFAULT_SOLVER == "exact"
    assert solver_names(uses_hazards=True) == ("risk",)
    assert solver_names(uses_hazards=False) == ("exact", "heuristic")


def test_every_place_that_offers_solvers_reads_the_table():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices

    def solver_option(verb: str) -> argparse.Action:
        return next(a for a in commands[verb]._actions if a.dest == "solver")

    assert tuple(solver_option("plan").choices) == solver_names(uses_hazards=False)  # plan has no hazards
    assert tuple(solver_option("run").choices) == solver_names()
    assert solver_option("plan").default == solver_option("run").default == DEFAULT_SOLVER
    field = TrainRequest.model_fields["solver"]
    assert get_args(field.annotation) == solver_names() and field.default == DEFAULT_SOLVER


def test_an_unknown_solver_is_refused_with_the_names_there_are():
    with pytest.raises(UserInputError, match=r"unknown solver 'simplex' \(exact, heuristic or risk\)"):
        build_problem(PlanRequest(load_profile(SHIPPED_PROFILE), 0.8, 2600.0, solver="simplex"))
    with pytest.raises(ValueError, match="registered twice"):
        register("exact")(lambda problem: None)


def test_solve_dispatches_to_the_registered_function(monkeypatch):
    """A solver filed under a new name is accepted and called: nothing else spells the names."""
    exact = get_solver("exact").solve
    seen = []

    def probe(problem):
        seen.append(problem.request.solver)
        return exact(problem)

    monkeypatch.setitem(SOLVERS, "probe", Solver("probe", probe))
    result = solve(PlanRequest(load_profile(SHIPPED_PROFILE), 0.8, 2600.0, solver="probe"))
    assert seen == ["probe"] and result.solver == "probe" and result.feasible
