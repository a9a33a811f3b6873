"""The local disk as a Store. The trace writer keeps its own local write path (fsync, atomic
rename, flock): this backend exists so code written against Store runs on a folder too, with
the same durability (fsync of the file and its folder)."""

from __future__ import annotations

import os

from traces.storage.base import ObjectStat, PreconditionFailed, Store


def _generation(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    scheme = "file"

    def url(self, key: str) -> str:
        return key

    def read(self, key: str) -> bytes:
        self._count("get")
        with open(key, "rb") as f:
            data = f.read()
        self.counts["bytes"] += len(data)
        return data

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        self._count("range", size)
        fd = os.open(key, os.O_RDONLY)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def list(self, prefix: str) -> tuple[dict[str, int], list[str]]:
        self._count("list")
        files, dirs = {}, []
        try:
            entries = list(os.scandir(prefix))
        except FileNotFoundError:
            return {}, []
        for e in entries:
            if e.is_dir():
                dirs.append(e.name)
            elif e.is_file():
                files[e.name] = e.stat().st_size
        return files, sorted(dirs)

    def stat(self, key: str) -> ObjectStat | None:
        self._count("stat")
        try:
            st = os.stat(key)
        except FileNotFoundError:
            return None
        return ObjectStat(st.st_size, _generation(st))

    def _write_tmp(self, key: str, data: bytes) -> str:
        tmp = f"{key}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def write_if_absent(self, key: str, data: bytes) -> str:
        self._count("put", len(data))
        tmp = self._write_tmp(key, data)
        try:
            os.link(tmp, key)  # fails if `key` exists: the local form of if_generation_match=0
        except FileExistsError:
            raise PreconditionFailed(f"{key}: already exists") from None
        finally:
            os.unlink(tmp)
        _fsync_dir(key)
        return _generation(os.stat(key))

    def write_if_generation(self, key: str, data: bytes, generation: str) -> str:
        # Check-then-rename is not atomic between processes on a local disk; local runs keep
        # their flock, which is what makes them single-writer.
        self._count("put", len(data))
        current = self.stat(key)
        if current is None or current.generation != generation:
            raise PreconditionFailed(f"{key}: changed since generation {generation}")
        tmp = self._write_tmp(key, data)
        os.replace(tmp, key)
        _fsync_dir(key)
        return _generation(os.stat(key))

    def delete(self, key: str) -> None:
        self._count("delete")
        os.unlink(key)
