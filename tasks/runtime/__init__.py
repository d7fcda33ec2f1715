"""The training runtime: asynchronous parameter-server training on torch.distributed (gloo).

Modules: workloads (what is trained), wire (the PS <-> worker messages), shaping (emulated network
bandwidth), telemetry (JSON lines the orchestrator tails), checkpoint (atomic, verified), ps (the
server), worker (the worker loop), driver (the plain-Python API the flows call), traces (spot
preemption traces replayed by the local provider), bench (`spotfill bench runtime`).
See docs/runtime.md.
"""
