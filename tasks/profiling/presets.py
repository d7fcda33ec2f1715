"""Ready-made profiling setups for the `local` provider (the emulated spot cloud).

The emulation is set so that the model's terms are all visible: compute is padded to
`reference_compute_s / relative_speed` of each type, one worker alone spends `comm_alone_s` on its
push and pull (the provider's bandwidth_scale is derived from the workload's parameter size), and
the PS's NIC is `ps_share` times one worker's, so larger clusters saturate it (the contention
regime). Both types of the quick preset have the same NIC (10 Gigabit), as the model has one Breq.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tasks.core.errors import UserInputError
from tasks.providers.local import LocalProvider, default_types


@dataclass(frozen=True)
class Preset:
    name: str
    workload: str
    workload_options: dict
    types: tuple[str, ...]
    batch_per_gpu: int
    reference_compute_s: float  # the fastest type's padded compute per iteration
    comm_alone_s: float  # one worker's emulated push + pull time alone
    ps_share: float  # PS NIC / one worker's NIC
    iterations: int  # single-type profiling
    fit_clusters: tuple[dict, ...]
    cluster_duration_s: float  # each fit cluster trains at least this long...
    validation_configs: tuple[dict, ...]
    loss_target: float
    parallel: int = 1  # validation runs at once (1: no run disturbs another's timing)
    clusters_side_by_side: int = 1  # fit clusters trained at once (1: each alone, as validation trains)
    repeats: int = 2  # validation runs per configuration (observed = their mean; validate.py)
    settings: dict = field(default_factory=dict)
    cluster_budget_s: float = 300.0  # ...and on until they share a loss band (and near a target), within this (all waves)

    def emulation(self, param_mb: float, nic_megabits_per_s: float) -> dict:
        """Provider and PS settings: bandwidth_scale for the provider, ps_megabits_per_s for runs."""
        worker_megabits = 2 * param_mb * 8 / self.comm_alone_s
        return {"bandwidth_scale": worker_megabits / nic_megabits_per_s,
                "ps_megabits_per_s": self.ps_share * worker_megabits,
                "reference_compute_s": self.reference_compute_s}


P3, G3 = "p3.2xlarge", "g3.8xlarge"
# Six clusters of 2 to 7 workers, each trained alone (clusters_side_by_side = 1) as a validation
# run trains (side by side on 2 cores the workers' emulated compute overran its padding, and the
# contention fit read a lighter PS than the one it predicts): three heterogeneous ones whose WA
# batch sizes (about 17.6 to 26 samples) span the validation clusters', and three of one type
# (3 x p3.2xlarge at bw 16; 2 and 4 x g3.8xlarge at bw 32) at the ends of the batch range. The
# large-batch type at two sizes is what tells the staleness cost of the batch (loss.batch_staleness)
# from the n-shape: with 2 x g3.8xlarge alone the fit predicted 4 x g3.8xlarge 12-18% short of
# the updates it took (docs/profiling.md, "Which clusters, and why"). No single
# worker: one worker's gradients are never stale, and under the runtime's asynchronous rule
# (tasks/runtime/async_rule.py) p3.2xlarge alone needs about as many updates to a target as
# p3 + g3 (65 and 59), while from two workers to seven they grow as about n^0.6. No n-shape of
# Eq. 3 follows both; fitted with the singles, the curve over-predicted every 2-4-worker
# cluster by 10-22%. One worker is outside the fitted range (docs/profiling.md).
FIT_CLUSTERS = ({P3: 1, G3: 1}, {P3: 1, G3: 3}, {P3: 6, G3: 1}, {P3: 3}, {G3: 2}, {G3: 4})

# Held out: one cluster of one-GPU workers (p3.2xlarge), one of multi-GPU workers only (g3.8xlarge:
# two replicas each, summing over the instance's PCIe), and mixed ones, so the error of each kind
# shows beside the others' (`spotfill validate`, "GPUs/worker").
QUICK = Preset(
    name="quick", workload="transformer-lm", workload_options={"seq_len": 32}, types=(P3, G3), batch_per_gpu=16,
    reference_compute_s=0.1, comm_alone_s=0.05, ps_share=1.25, iterations=30,
    fit_clusters=FIT_CLUSTERS, cluster_duration_s=20.0,
    validation_configs=({P3: 2}, {P3: 1, G3: 2}, {P3: 3, G3: 1}, {G3: 3}, {P3: 4, G3: 2}),
    loss_target=1.9, parallel=1,
)

FULL = Preset(
    name="full", workload="transformer-lm", workload_options={"seq_len": 32}, types=(P3, G3), batch_per_gpu=16,
    reference_compute_s=0.1, comm_alone_s=0.05, ps_share=1.25, iterations=30,
    fit_clusters=FIT_CLUSTERS, cluster_duration_s=40.0,
    validation_configs=({P3: 2}, {P3: 1, G3: 2}, {P3: 3, G3: 1}, {P3: 2, G3: 3}, {P3: 4, G3: 2}, {P3: 5, G3: 1},
                        {G3: 5}),
    loss_target=1.9, parallel=1,
)

PRESETS = {p.name: p for p in (QUICK, FULL)}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserInputError(f"unknown profiling preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def local_nic_mbytes_per_s(p: Preset) -> float:
    """The one NIC speed of `p`'s types on the local provider (the model has one Breq)."""
    types = {t.name: t for t in default_types()[0]}
    nics = {types[name].network_mbytes_per_s for name in p.types}
    if len(nics) != 1:
        raise UserInputError(f"preset {p.name}: types {p.types} have different NICs {sorted(nics)}; the model has one Breq")
    return nics.pop()


def local_provider(p: Preset, artifacts_dir: Path):
    """A LocalProvider emulating `p`'s network, and the PS cap (megabits/s) for its runs."""
    from tasks.profiling.single import param_mb  # deferred: scipy (start-up cost)

    e = p.emulation(param_mb(p.workload, p.workload_options), 8.0 * local_nic_mbytes_per_s(p))
    provider = LocalProvider(artifacts_dir, bandwidth_scale=e["bandwidth_scale"], reference_compute_s=e["reference_compute_s"])
    return provider, e
