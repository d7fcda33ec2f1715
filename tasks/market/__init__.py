"""The spot market: real revocation traces, per-type hazards, a replay simulator, the policies it
compares, and the risk-aware planner (`solver="risk"`)."""
