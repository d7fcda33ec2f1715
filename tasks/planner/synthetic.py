"""Synthetic instance types for planner benchmarks beyond the five shipped ones.

Generated with a fixed seed, shaped like real GPU offers: 1-8 GPUs, 256-1024 samples per GPU,
per-GPU speed between a K80's and a V100's on ResNet-110 (800-3000 samples/s, from the shipped
profile), a spot price that buys 1000-3000 samples/s per dollar-hour (the shipped types span
1030-2940), and an on-demand price 2.5-3.5x the spot price.
"""
from __future__ import annotations

import numpy as np

from tasks.core.profile import Profile


def extend_profile(profile: Profile, n_types: int, quota: int, seed: int = 7) -> Profile:
    """The profile's first types (up to n_types), then synthetic ones up to n_types, all with
    the given quota."""
    rng = np.random.default_rng(seed)
    data = profile.model_dump()
    types = data["instances"][:n_types]
    for i in range(len(types), n_types):
        gpus = int(rng.choice([1, 2, 4, 8]))
        batch_per_gpu = int(rng.choice([256, 512, 1024]))
        per_gpu_samples_s = float(rng.uniform(800, 3000))
        multi_gpu_loss = 1.0 + 0.03 * np.log2(gpus)
        spot = gpus * per_gpu_samples_s / float(rng.uniform(1000, 3000))
        types.append({
            "type": f"syn{i:02d}.{gpus}gpu", "gpus": gpus, "batch_per_gpu": batch_per_gpu,
            "compute_time_s": round(batch_per_gpu / per_gpu_samples_s * multi_gpu_loss, 6),
            "spot_price": round(spot, 4), "on_demand_price": round(spot * float(rng.uniform(2.5, 3.5)), 4),
            "quota": quota,
        })
    for t in types:
        t["quota"] = quota
    data["instances"] = types
    data["workload"] = f"{profile.workload}-{n_types}types-q{quota}"
    return Profile.model_validate(data)
