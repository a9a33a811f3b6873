"""Google Cloud Storage through the official client (google-cloud-storage).

Range reads are download_as_bytes(start, end); listing is one delimited list_blobs; conditional
writes are if_generation_match (0: only if absent). Credentials are the usual ones
(Application Default Credentials); with STORAGE_EMULATOR_HOST set (a local emulator) the client
is anonymous.
"""

from __future__ import annotations

import os

from traces.storage.base import ObjectStat, PreconditionFailed, StorageError, Store

WHAT_TO_DO = "check the URL and your credentials (gcloud auth application-default login)"


class GCSStore(Store):
    scheme = "gs"

    def __init__(self, bucket: str):
        super().__init__()
        self.bucket = bucket
        try:
            from google.cloud import storage
        except ImportError:
            raise StorageError(f"gs://{bucket}: reading gs:// runs needs google-cloud-storage: "
                               "pip install 'replay-jax[remote]'") from None
        try:
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials
                self.client = storage.Client(project="replay-emulator", credentials=AnonymousCredentials())
            else:
                self.client = storage.Client()
        except Exception as e:  # noqa: BLE001 - google.auth's errors have no common base worth importing
            raise StorageError(f"gs://{bucket}: cannot use Google Cloud Storage ({_short(e)}); {WHAT_TO_DO}") from None
        self._bucket = self.client.bucket(bucket)

    def _fail(self, key: str, e: Exception) -> Exception:
        from google.api_core import exceptions as gexc
        if isinstance(e, gexc.NotFound):
            return FileNotFoundError(2, "no such object", self.url(key))
        if isinstance(e, gexc.PreconditionFailed):
            return PreconditionFailed(f"{self.url(key)}: changed by another writer (precondition failed)")
        return StorageError(f"{self.url(key)}: cannot be read from Google Cloud Storage ({_short(e)}); {WHAT_TO_DO}")

    def read(self, key: str) -> bytes:
        self._count("get")
        try:
            data = self._bucket.blob(key).download_as_bytes()
        except Exception as e:  # noqa: BLE001 - mapped in _fail
            raise self._fail(key, e) from None
        with self._lock:
            self.counts["bytes"] += len(data)
        return data

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        self._count("range", size)
        from google.api_core import exceptions as gexc
        try:
            return self._bucket.blob(key).download_as_bytes(start=offset, end=offset + size - 1, checksum=None)
        except gexc.RequestRangeNotSatisfiable:
            return b""  # past the end, as pread returns
        except Exception as e:  # noqa: BLE001
            raise self._fail(key, e) from None

    def list(self, prefix: str) -> tuple[dict[str, int], list[str]]:
        self._count("list")
        try:
            it = self.client.list_blobs(self.bucket, prefix=prefix, delimiter="/")
            files = {b.name[len(prefix):]: int(b.size or 0) for b in it}
            dirs = sorted(p[len(prefix):].rstrip("/") for p in it.prefixes)
        except Exception as e:  # noqa: BLE001
            err = self._fail(prefix, e)
            if isinstance(err, FileNotFoundError):  # no such bucket: nothing is there
                return {}, []
            raise err from None
        self.counts["list"] += max(0, it.page_number - 1)  # every further page is a request too
        return files, dirs

    def stat(self, key: str) -> ObjectStat | None:
        self._count("stat")
        try:
            blob = self._bucket.get_blob(key)
        except Exception as e:  # noqa: BLE001
            raise self._fail(key, e) from None
        return None if blob is None else ObjectStat(int(blob.size or 0), str(blob.generation))

    def _upload(self, key: str, data: bytes, generation: int) -> str:
        self._count("put", len(data))
        blob = self._bucket.blob(key)
        try:
            blob.upload_from_string(data, if_generation_match=generation)
        except Exception as e:  # noqa: BLE001
            raise self._fail(key, e) from None
        return str(blob.generation)

    def write_if_absent(self, key: str, data: bytes) -> str:
        return self._upload(key, data, 0)

    def write_if_generation(self, key: str, data: bytes, generation: str) -> str:
        return self._upload(key, data, int(generation))

    def delete(self, key: str) -> None:
        self._count("delete")
        try:
            self._bucket.blob(key).delete()
        except Exception as e:  # noqa: BLE001
            raise self._fail(key, e) from None


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or e.__class__.__name__
