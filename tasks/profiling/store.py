"""Profiles on disk: a directory per (workload, options, types, settings, code version).

    profiles/measured/<workload>-<key>/profile.json   the contract profile + provenance + fit quality
                                     /types.csv        one row per profiled type
                                     /type_steps.csv   every measured iteration of the single-type runs
                                     /cluster_workers.csv, /cluster_losses.csv   the cluster runs
The key hashes the workload, its options, the types, the emulation settings and the code version
(a hash of the runtime's and the profiler's source), so a change of any of them profiles again.
A profile directory is written whole into a temporary directory and renamed into place: a failed
profile leaves nothing behind, and a reader never sees half of one.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tasks.core.atomic import atomic_write_json
from tasks.profiling.fit import FittedProfile
from tasks.profiling.measurements import ClusterMeasurement, TypeMeasurement, cluster_label

REPO = Path(__file__).resolve().parents[2]
CODE_SOURCES = ("tasks/profiling", "tasks/runtime", "tasks/providers/local.py")
MEASURED = "measured"


@dataclass
class RawMeasurements:
    types: list[TypeMeasurement]
    clusters: list[ClusterMeasurement]


def code_version() -> str:
    """A hash of the source files that decide what is measured and how (12 hex digits)."""
    digest = hashlib.sha256()
    for source in CODE_SOURCES:
        path = REPO / source
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            digest.update(str(f.relative_to(REPO)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def cache_key(workload: str, types: list[str], workload_options: dict | None = None, settings: dict | None = None) -> str:
    blob = json.dumps({"workload": workload, "options": workload_options or {}, "types": sorted(types),
                       "settings": settings or {}, "code": code_version()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def profile_dir(directory: Path, workload: str, key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in workload)
    return Path(directory) / MEASURED / f"{safe}-{key}"


def cached_profile(workload: str, types: list[str], *, workload_options: dict | None = None, settings: dict | None = None,
                   directory: str | Path = "profiles") -> Path | None:
    """The saved profile.json for exactly this workload, types, settings and code version, if any."""
    path = profile_dir(Path(directory), workload, cache_key(workload, types, workload_options, settings)) / "profile.json"
    return path if path.is_file() else None


def provenance(provider: str, types: list[str], workload_options: dict | None, settings: dict | None,
               wall_s: dict | None = None) -> dict:
    return {"code_version": code_version(), "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "provider": provider, "types": list(types), "workload_options": workload_options or {},
            "settings": settings or {}, "wall_s": wall_s or {}}


def raw_frames(raw: RawMeasurements) -> dict:
    import pandas as pd

    types = pd.DataFrame([m.model_dump(exclude={"steps", "memory_points"}) for m in raw.types])
    steps = pd.DataFrame([{"type": m.type, **s} for m in raw.types for s in m.steps])
    workers = pd.DataFrame([{"cluster": cluster_label(c.cluster), "n": c.n, **w.model_dump()}
                            for c in raw.clusters for w in c.workers])
    losses = pd.DataFrame([{"cluster": cluster_label(c.cluster), "update": j, "smoothed_loss": loss}
                           for c in raw.clusters for j, loss in c.losses])
    return {"types.csv": types, "type_steps.csv": steps, "cluster_workers.csv": workers, "cluster_losses.csv": losses}


def save_profile(fitted: FittedProfile, raw: RawMeasurements, directory: str | Path = "profiles", *,
                 key: str | None = None, provenance_info: dict | None = None) -> Path:
    """Write the profile directory atomically; returns the path of its profile.json."""
    profile = fitted.profile
    key = key or cache_key(profile.workload, profile.type_names)
    final = profile_dir(Path(directory), profile.workload, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        data = profile.model_dump()
        data["provenance"] = provenance_info or {}
        data["fit"] = {name: q.model_dump() for name, q in fitted.quality.items()}
        if fitted.form is not None:
            data["fit"]["form"] = fitted.form.model_dump()
        atomic_write_json(staging / "profile.json", data)
        for name, frame in raw_frames(raw).items():
            frame.to_csv(staging / name, index=False)
        os.chmod(staging, 0o755)
        if final.exists():
            trash = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old."))
            os.replace(final, trash / "old")
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final / "profile.json"
