"""The training runtime: asynchronous parameter-server training on torch.distributed (gloo).

Modules: workloads (what is trained), flat (parameters and buffers in one vector), pieces, push
and pull (that vector on the wire in pieces, overlapped with backward and forward), wire (the
PS <-> worker messages), shaping (emulated network bandwidth), async_rule (how a stale gradient
is applied), stagger (same-type workers taking turns on the PS link), telemetry (JSON lines the orchestrator tails), checkpoint (atomic, verified), durable
(checkpoints and the lease in S3), cuts (consistent checkpoints of sharded servers), ps (the
server), worker (the worker loop), lease (how long a run trains with no orchestrator), lifetime
(noticing the orchestrator of a run without a lease is gone), driver (the plain-Python API the
flows call).
See docs/runtime.md.
"""
