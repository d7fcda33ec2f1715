"""The spot market: per-type hazards from real revocation traces, a replay simulator, and the
policies it compares (one of them the planner's risk-aware solver, tasks/planner/risk.py)."""
