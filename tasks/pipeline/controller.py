"""The watch loop's decisions, as a plain function of one poll: end the run, re-plan after a
revocation, act on drift (once per plan, the way `drift_action` says), take a re-plan asked for
from outside for the plan in effect. The flow carries the actions out; tests drive this with made-up polls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tasks.pipeline.session import Observation
from tasks.pipeline.watch import DriftHold, refit_ratio

ActionKind = Literal["done", "replan", "refit", "announce-drift"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str  # done: target / deadline / stopped / no workers; replan: revocation / drift / requested / probe
    leaving: tuple[str, ...] = ()  # replan: instances with a notice, not counted as survivors
    speed_ratio: float | None = None  # refit, announce-drift: observed / predicted progress


def decide(obs: Observation, *, target_loss: float, deadline_s: float, drift_action: str,
           drift_ratio: float | None, drift: DriftHold, asked: dict | None, plan_empty: bool,
           known_leaving: frozenset[str] = frozenset(), probe_due: bool = False) -> list[Action]:
    """What to do after this poll, in order. `drift_ratio` is the drift detector's verdict (None:
    no drift), `drift` the plan's hold (announced already?, the newest ratio), `asked` a re-plan
    request the automation left for this run (acted on only if it names the plan in effect: one
    for an earlier plan was answered by the re-plan since), `plan_empty` whether the plan in
    effect has no workers (the market left none to launch), `known_leaving` the instances already
    re-planned around (their notice came earlier: their end is no news), `probe_due` whether it is
    time to try spot again (on-demand workers run or the market refused a spot type:
    session.probe_due). A refit takes a ratio in (0, 1] only; with any other the re-plan acts alone."""
    if obs.loss is not None and obs.loss <= target_loss:
        return [Action("done", "target")]
    if obs.t_s >= deadline_s:
        return [Action("done", "deadline")]
    if obs.stopped:
        return [Action("done", "stopped")]
    if not obs.workers and plan_empty:
        return [Action("done", "no workers")]
    actions, reasons = [], []
    leaving = tuple(e.instance_id for e in obs.events
                    if e.kind in ("revocation_notice", "revoked") and e.instance_id not in known_leaving)
    if leaving:
        reasons.append("revocation")
    if drift_ratio is not None and drift_action == "inline":
        if refit_ratio(drift_ratio) is not None:
            actions.append(Action("refit", "drift", speed_ratio=drift_ratio))
        reasons.append("drift")
    elif drift_ratio is not None and not drift.announced:
        actions.append(Action("announce-drift", "drift", speed_ratio=drift_ratio))
    if asked is not None and drift_action == "automation" and drift.answers(asked):
        if refit_ratio(drift.newest_ratio) is not None:
            actions.append(Action("refit", "requested", speed_ratio=drift.newest_ratio))
        reasons.append("requested")
    if probe_due:
        reasons.append("probe")
    if reasons:  # one re-plan however many reasons, after any refit
        actions.append(Action("replan", "+".join(reasons), leaving))
    return actions
