"""The solvers by name: the one table `planner.solve` dispatches from and every caller takes the
names from (the CLI's --solver choices, the flow's parameter model, the checks).

Each solver registers itself where its answer is built (plain.py: exact and heuristic; risk.py:
risk), so no solver climbs back up to the dispatch. This module imports nothing of the planner
(problem.py checks a request's solver here), not even the types a solver takes and gives. The
package's __init__ imports every solver module, so the table is whole once `tasks.planner` is
imported; its order (the order of registration) is the order choices are listed in.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tasks.core.errors import UserInputError

DEFAULT_SOLVER = "exact"


@dataclass(frozen=True)
class Solver:
    name: str
    solve: Callable  # (Problem) -> PlanResult; an infeasible problem comes back with status "infeasible"
    # Plans against per-type revocation hazards to a target probability: the request's hazards,
    # level and recovery time are its input (`spotfill plan` has no source of hazards), and its
    # answer does not scale with the remaining progress (hazards act in absolute time).
    uses_hazards: bool = False


SOLVERS: dict[str, Solver] = {}


def register(name: str, *, uses_hazards: bool = False) -> Callable:
    """Decorator: file a solve function under `name`."""

    def add(solve: Callable) -> Callable:
        if name in SOLVERS:
            raise ValueError(f"solver {name!r} is registered twice")
        SOLVERS[name] = Solver(name, solve, uses_hazards)
        return solve

    return add


def solver_names(*, uses_hazards: bool | None = None) -> tuple[str, ...]:
    """The registered names in order; uses_hazards=True or False: only the solvers that do (not)."""
    return tuple(n for n, s in SOLVERS.items() if uses_hazards is None or s.uses_hazards == uses_hazards)


def get_solver(name: str) -> Solver:
    """The solver filed under `name`, or UserInputError listing those there are."""
    if name not in SOLVERS:
        *rest, last = solver_names()
        raise UserInputError(f"unknown solver {name!r} ({', '.join(rest)} or {last})")
    return SOLVERS[name]
