"""Checkpoints kept off the parameter server's own disk: an on-demand PS instance that fails must
not take the run's progress with it.

The PS (`--durable-url s3://BUCKET/PREFIX`) copies each checkpoint it writes to S3 through boto3
(credentials and endpoint from boto3's default chain, e.g. AWS_ENDPOINT_URL for moto), and a PS
that starts with no newer checkpoint on its disk first fetches the newest one from there, so a
restart on a new instance resumes where the old one stopped. Locally the run folder is already
that durable store, and no URL is given. A failed copy is reported, not fatal: training goes on
and the next checkpoint tries again.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from tasks.core.atomic import atomic_write_bytes
from tasks.core.errors import UserInputError
from tasks.runtime import checkpoint


class S3Checkpoints:
    """Checkpoint files under s3://bucket/prefix/, named as on disk (checkpoint.path_of)."""

    def __init__(self, url: str, client=None):
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise UserInputError(f"durable checkpoint URL must be s3://BUCKET/PREFIX, got {url[:80]!r}")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.s3 = client or _client()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def upload(self, path: Path, keep: int = checkpoint.KEEP) -> str:
        """Copy one checkpoint file, then delete all but the newest `keep` there; returns its key."""
        key = self.key(path.name)
        self.s3.upload_file(str(path), self.bucket, key)
        stored = self.stored()
        for _, old in stored[:-keep]:
            self.s3.delete_object(Bucket=self.bucket, Key=old)
        return key

    def stored(self) -> list[tuple[int, str]]:
        """(number, key) of the checkpoints stored, oldest first."""
        found = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key("")):
            for item in page.get("Contents", []):
                number = checkpoint.number_in(item["Key"].rsplit("/", 1)[-1])
                if number is not None:
                    found.append((number, item["Key"]))
        return sorted(found)

    def newest_number(self) -> int | None:
        stored = self.stored()
        return stored[-1][0] if stored else None

    def fetch_newest(self, directory: Path) -> Path | None:
        """The newest checkpoint in S3 copied into `directory` (atomically), unless the folder
        already holds one at least as new; returns the file fetched, or None."""
        newest = self.newest_number()
        local = [checkpoint.number_of(p) for p in checkpoint.list_checkpoints(directory)] if directory.exists() else []
        if newest is None or (local and max(local) >= newest):
            return None
        path = checkpoint.path_of(directory, newest)
        body = self.s3.get_object(Bucket=self.bucket, Key=self.key(path.name))["Body"].read()
        return atomic_write_bytes(path, body, mode=0o600)


def _split(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc or not parsed.path.strip("/"):
        raise UserInputError(f"S3 object URL must be s3://BUCKET/KEY, got {url[:80]!r}")
    return parsed.netloc, parsed.path.lstrip("/")


_CLIENTS: dict[str, object] = {}


def _client():
    """One S3 client per process (boto3's default chain), made on first use."""
    if "s3" not in _CLIENTS:
        import boto3  # deferred: only runs on AWS need it

        _CLIENTS["s3"] = boto3.client("s3")
    return _CLIENTS["s3"]


def write_object(url: str, data: bytes) -> None:
    bucket, key = _split(url)
    _client().put_object(Bucket=bucket, Key=key, Body=data)


def read_object(url: str) -> str:
    bucket, key = _split(url)
    return _client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
