"""Amazon S3 (and S3-compatible stores) through the official client (boto3).

Range reads are GetObject with Range; listing is ListObjectsV2 with a delimiter; conditional
writes are PutObject with IfNoneMatch="*" (only if absent) or IfMatch=ETag. The endpoint and
credentials are boto3's usual ones (AWS_ENDPOINT_URL points it at a local emulator).
"""

from __future__ import annotations

from traces.storage.base import ObjectStat, PreconditionFailed, StorageError, Store

WHAT_TO_DO = "check the URL, your AWS credentials and AWS_ENDPOINT_URL"


class S3Store(Store):
    scheme = "s3"

    def __init__(self, bucket: str):
        super().__init__()
        self.bucket = bucket
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise StorageError(f"s3://{bucket}: reading s3:// runs needs boto3: pip install 'replay-jax[remote]'") from None
        try:  # a pool as large as the threads that open a run's segments in parallel
            self.client = boto3.client("s3", config=Config(max_pool_connections=16, retries={"mode": "standard"}))
        except Exception as e:  # noqa: BLE001 - botocore's errors: no region, bad endpoint, ...
            raise StorageError(f"s3://{bucket}: cannot use S3 ({_short(e)}); {WHAT_TO_DO}") from None

    def _fail(self, key: str, e: Exception) -> Exception:
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(2, "no such object", self.url(key))
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            return PreconditionFailed(f"{self.url(key)}: changed by another writer (precondition failed)")
        return StorageError(f"{self.url(key)}: cannot be read from S3 ({_short(e)}); {WHAT_TO_DO}")

    def read(self, key: str) -> bytes:
        self._count("get")
        try:
            data = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as e:  # noqa: BLE001 - mapped in _fail
            raise self._fail(key, e) from None
        with self._lock:
            self.counts["bytes"] += len(data)
        return data

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        self._count("range", size)
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + size - 1}")
            return got["Body"].read()
        except Exception as e:  # noqa: BLE001
            if str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) == "InvalidRange":
                return b""  # past the end, as pread returns
            raise self._fail(key, e) from None

    def list(self, prefix: str) -> tuple[dict[str, int], list[str]]:
        files, dirs = {}, []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                               Delimiter="/"):
                self._count("list")
                files.update({o["Key"][len(prefix):]: int(o["Size"]) for o in page.get("Contents", [])})
                dirs += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        except Exception as e:  # noqa: BLE001
            if str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) == "NoSuchBucket":
                return {}, []
            raise self._fail(prefix, e) from None
        return files, sorted(dirs)

    def stat(self, key: str) -> ObjectStat | None:
        self._count("stat")
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as e:  # noqa: BLE001
            err = self._fail(key, e)
            if isinstance(err, FileNotFoundError):
                return None
            raise err from None
        return ObjectStat(int(head["ContentLength"]), head["ETag"])

    def _put(self, key: str, data: bytes, **condition) -> str:
        self._count("put", len(data))
        try:
            return self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **condition)["ETag"]
        except Exception as e:  # noqa: BLE001
            raise self._fail(key, e) from None

    def write_if_absent(self, key: str, data: bytes) -> str:
        return self._put(key, data, IfNoneMatch="*")

    def write_if_generation(self, key: str, data: bytes, generation: str) -> str:
        return self._put(key, data, IfMatch=generation)

    def delete(self, key: str) -> None:
        self._count("delete")
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as e:  # noqa: BLE001
            raise self._fail(key, e) from None


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or e.__class__.__name__
