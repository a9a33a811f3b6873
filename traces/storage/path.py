"""RemotePath: the part of pathlib.Path the run readers use, answered from an object store.

A run opened from a URL gets one `View`: each folder is listed once (one delimited list
request) and every exists/is_file/is_dir/stat/glob under it is answered from that listing (the
run's own folder is listed, never the one above it, which may hold every run in the bucket), so
opening a run costs its listings plus the byte ranges it reads. A view is a snapshot: a run
still being written is read as it was when opened, as a local reader reads the files it found.
`prefetch` reads many ranges at once (threads), for opening O(segments) in parallel.
"""

from __future__ import annotations

import fnmatch
import io
import threading
from concurrent.futures import ThreadPoolExecutor

from traces.storage import tails
from traces.storage.base import Store

PARALLEL = 16  # ranges requested at once when opening (each ~20 ms from a VM to its region's bucket)


class View:
    def __init__(self, store: Store):
        self.store = store
        self._listings: dict[str, tuple[dict[str, int], list[str]]] = {}
        self._ranges: dict[tuple[str, int, int], bytes] = {}
        self._lock = threading.Lock()
        self._joined: dict[str, bytes] = {}  # an unsealed segment's bytes, joined from its tail objects
        self.tail_damage: dict[str, tuple[str, int]] = {}  # such a segment's key -> (what ended it, at byte)
        self.tail_objects: dict[str, int] = {}  # such a segment's key -> how many tail objects it has (numbered)

    def listing(self, folder: str) -> tuple[dict[str, int], list[str]]:
        if folder not in self._listings:
            files, dirs = self.store.list(folder + "/" if folder else "")
            self._listings[folder] = self._join_tails(folder, files), dirs
        return self._listings[folder]

    def _join_tails(self, folder: str, files: dict[str, int]) -> dict[str, int]:
        """A segment still being written (or left by a crash) is its tail objects joined
        (traces/storage/tails.py), after its own object when a resumed writer continues one (its
        first tail starts where the object ends); tails the object already holds (it was sealed,
        or uploaded whole at a close, after them) are ignored."""
        groups: dict[str, list[str]] = {}
        for name in files:
            parsed = tails.parse_name(name)
            if parsed is not None:
                groups.setdefault(parsed[0], []).append(name)
        if not groups:
            return files
        kept = {n: size for n, size in files.items() if tails.parse_name(n) is None}
        for segment, names in groups.items():
            names.sort(key=lambda n: tails.parse_name(n)[1])
            keys = [f"{folder}/{n}" if folder else n for n in names]
            key = f"{folder}/{segment}" if folder else segment
            base = kept.get(segment)
            if base is not None and self._superseded(key, base, keys[0]):
                continue  # in the segment's object already (a kill between its upload and their deletion)
            with ThreadPoolExecutor(min(PARALLEL, len(keys))) as pool:
                datas = list(pool.map(self._read_or_none, keys))
            if None in datas:  # a tail deleted since the listing: the writer sealed the segment meanwhile
                sealed = self.store.stat(key)
                if sealed is not None:
                    kept[segment] = sealed.size
                    continue
            head = b"" if base is None else self.store.read(key)
            data, why, stop = tails.join(list(zip(names, datas)), len(head))
            self.tail_objects[key] = tails.parse_name(names[-1])[1] + 1
            self._joined[key] = head + data
            kept[segment] = len(head) + len(data)
            if why is not None:
                self.tail_damage[key] = (why, stop)
        return kept

    def _superseded(self, key: str, size: int, first_tail: str) -> bool:
        """Whether a segment's object holds its tail objects' bytes: it is sealed, or its first
        tail starts before it ends (uploaded whole after them). A damaged first tail is not."""
        from traces.segment import SEAL_SIZE, parse_seal  # (traces.segment reads through this module)

        if size >= SEAL_SIZE and parse_seal(self.store.read_range(key, size - SEAL_SIZE, SEAL_SIZE)) is not None:
            return True
        start = tails.start_of(self._read_or_none(first_tail))
        return start is not None and start < size

    def _read_or_none(self, key: str) -> bytes | None:
        try:
            return self.store.read(key)
        except FileNotFoundError:  # deleted since the listing: sealed meanwhile (the next open sees the segment)
            return None

    def read(self, key: str) -> bytes:
        joined = self._joined.get(key)
        return self.store.read(key) if joined is None else joined

    def listed(self, folder: str) -> tuple[dict[str, int], list[str]] | None:
        return self._listings.get(folder)

    def size(self, key: str) -> int | None:
        """From the folder's listing once it is taken; before, one stat: the folder above a run (a
        bucket's top, every run in it) is never listed to learn about one object."""
        folder, _, name = key.rpartition("/")
        listed = self.listed(folder)
        if listed is not None:
            return listed[0].get(name)
        found = self.store.stat(key)
        return None if found is None else found.size

    def prefetch(self, ranges: list[tuple[str, int, int]]) -> None:
        todo = [r for r in ranges if r[2] > 0 and r not in self._ranges and r[0] not in self._joined]
        if not todo:
            return
        def get(r):
            try:
                return self.store.read_range(*r)
            except Exception:  # noqa: BLE001 - not kept: the reader's own read of it raises, where it is handled
                return None

        with ThreadPoolExecutor(min(PARALLEL, len(todo))) as pool:
            for r, data in zip(todo, pool.map(get, todo)):
                if data is not None:
                    with self._lock:
                        self._ranges[r] = data

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        joined = self._joined.get(key)
        if joined is not None:
            return joined[offset : offset + max(size, 0)]
        with self._lock:  # a prefetched range is read once: later reads go to the store
            data = self._ranges.pop((key, offset, size), None)
        return self.store.read_range(key, offset, size) if data is None else data


class _Stat:
    def __init__(self, size: int):
        self.st_size = size


class RemotePath:
    """gs://bucket/key or s3://bucket/key. Never os.fspath()-able: code that would open it as a
    local file fails loudly instead of reading a local path of the same name."""

    def __init__(self, view: View, key: str):
        self.view, self.key = view, key.strip("/")

    # names
    def __str__(self) -> str:
        return self.view.store.url(self.key)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __lt__(self, other: "RemotePath") -> bool:
        return self.key < other.key

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name) -> "RemotePath":
        return RemotePath(self.view, f"{self.key}/{str(name).strip('/')}" if self.key else str(name))

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        dot = self.name.rfind(".")
        return self.name[dot:] if dot > 0 else ""

    @property
    def stem(self) -> str:
        return self.name[: len(self.name) - len(self.suffix)]

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.view, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def with_name(self, name: str) -> "RemotePath":
        return self.parent / name

    def with_suffix(self, suffix: str) -> "RemotePath":
        return self.parent / (self.stem + suffix)

    # what is there (from the folder's listing)
    def _size(self) -> int | None:
        return self.view.size(self.key) if self.key else None

    def is_file(self) -> bool:
        return self._size() is not None

    def is_dir(self) -> bool:
        files, dirs = self.view.listing(self.key)
        return bool(files or dirs)

    def exists(self) -> bool:
        listed = self.view.listed(self.parent.key)
        if listed is not None and self.key:
            return self.name in listed[0] or self.name in listed[1]
        return self.is_dir() or self.is_file()

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> _Stat:
        size = self._size()
        if size is None:
            raise FileNotFoundError(2, "no such object", str(self))
        return _Stat(size)

    def iterdir(self):
        files, dirs = self.view.listing(self.key)
        return iter([self / n for n in sorted([*files, *dirs])])

    def glob(self, pattern: str):
        if "/" in pattern or "**" in pattern:
            raise ValueError(f"RemotePath.glob takes one folder level, not {pattern!r}")
        return iter([p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)])

    # contents
    def read_bytes(self) -> bytes:
        return self.view.read(self.key)

    def read_text(self, encoding: str | None = "utf-8", errors: str | None = None) -> str:
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")

    def read_range(self, offset: int, size: int) -> bytes:
        return self.view.read_range(self.key, offset, size)

    def open(self, mode: str = "rb"):
        """A file that reads by ranges: f.read(n) is one request for n bytes, not the whole object."""
        if mode not in ("r", "rb"):
            raise PermissionError(f"{self}: runs on object storage are read-only in this version of replay")
        raw = _RangeFile(self)
        return raw if mode == "rb" else io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8")


class _RangeFile(io.RawIOBase):
    def __init__(self, path: RemotePath):
        super().__init__()
        self.path, self.pos, self.size = path, 0, path.stat().st_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), max(0, self.size - self.pos))
        data = self.path.read_range(self.pos, n) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)
