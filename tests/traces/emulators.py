"""Real object-store emulators on 127.0.0.1 for the remote-run tests (never a mock of a client):
gcp-storage-emulator for gs:// (STORAGE_EMULATOR_HOST) and moto's server for s3://
(AWS_ENDPOINT_URL). Each starts in a thread of this process in well under a second, on a free port,
once per test session (per xdist worker), and points the official clients at itself.

Use: the fixtures `gcs` / `s3` (registered once for tests/traces by its conftest.py: never import them
into a test module, which would make a second emulator) give a bucket URL ("gs://replay-test");
`from tests.traces.emulators import upload`, then `upload(local_run, url)` copies a run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.ports import free_port

BUCKET = "replay-test"


logging.getLogger("werkzeug").setLevel(logging.WARNING)  # both servers log every request at INFO


@pytest.fixture(scope="session")
def gcs():
    pytest.importorskip("gcp_storage_emulator", reason="pip install -e '.[dev]' brings gcp-storage-emulator")
    from gcp_storage_emulator.server import create_server

    reads_like_gcs()
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    # http.server listens with a backlog of 5 and serves one request at a time: two processes' parallel
    # requests overflow it, and a dropped connect is retried after 1, 2, 4... s (seen: saves stalled minutes)
    server._api._httpd.socket.listen(128)
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",  # google-cloud-storage, gcsfs
           "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}",  # orbax's arrays (tensorstore's gcs driver)
           "FSSPEC_GS_TOKEN": "anon",  # gcsfs (orbax's folders through etils.epath): no credentials to look for
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else gcsfs asks a gRPC API the emulator lacks (60 s)
           "TENSORSTORE_GCS_REQUEST_CONCURRENCY": "1"}  # and fewer parallel requests for its one server thread
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"gs://{BUCKET}"
    finally:
        _forget("gs")
        server.stop()
        _restore(old)


def reads_like_gcs() -> None:  # (and writes)
    """Makes the emulator's object reads answer as GCS's do: with the object's generation in
    `x-goog-generation` (and metageneration), and honouring `ifGenerationMatch` (412) and
    `ifGenerationNotMatch` (304 Not Modified) on a GET; and its uploads honour `ifGenerationMatch`
    (412; 0 = create only), so the run lock's refusals are tested on gs:// too.
    gcp-storage-emulator 2026.7 does none of it.
    tensorstore's gcs driver relies on it: its OCDBT writer (orbax's multi-process save) writes
    manifest.ocdbt, then may revalidate it with ifGenerationNotMatch=<that generation>; the
    emulator's 200 with no generation fails the save with "Malformed StorageGeneration" in
    process 0's writer thread, so process 0 never writes array_metadatas/ and process 1 polls for
    that folder for ever (the trainer's two-process save "hanging" on gs://; seen with py-spy and
    the request log). Either answer alone (the header, or the 304) let the save finish (tried)."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def with_generation(handler):
        def read(request, response, storage, *args, **kwargs):
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except NotFound:  # the handler answers 404
                return handler(request, response, storage, *args, **kwargs)
            generation, query = str(obj["generation"]), request.query
            response["x-goog-generation"] = generation
            response["x-goog-metageneration"] = str(obj["metageneration"])
            if query.get("ifGenerationMatch", [generation])[0] != generation:
                response.status = HTTPStatus.PRECONDITION_FAILED
            elif query.get("ifGenerationNotMatch", [None])[0] == generation:
                response.status = HTTPStatus.NOT_MODIFIED
            else:
                handler(request, response, storage, *args, **kwargs)
        return read

    def with_write_preconditions(handler):
        """An upload's ifGenerationMatch (0: only if absent) answered as GCS does: 412 when the
        object's generation is another. Checked when an upload is made or a resumable one starts;
        the emulator serves one request at a time, so the check and the write are not interleaved."""
        def write(request, response, storage, *args, **kwargs):
            wanted = request.query.get("ifGenerationMatch", [None])[0]
            if wanted is not None:
                name = request.query.get("name", [None])[0]
                if name is None and isinstance(request.data, dict):  # multipart: its "meta"; resumable: the body
                    name = (request.data.get("meta") or request.data).get("name")
                try:
                    current = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
                except NotFound:
                    current = "0"
                if current != wanted:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                             "specified did not hold.", "errors": [{"reason": "conditionNotMet"}]}})
                    return None
            return handler(request, response, storage, *args, **kwargs)
        return write

    if getattr(objects.insert, "like_gcs", False):
        return
    for _, handlers in server.HANDLERS:  # the routes' table holds the functions themselves
        for method, handler in list(handlers.items()):
            if handler in (objects.get, objects.download):
                handlers[method] = with_generation(handler)
            elif handler is objects.insert:
                handlers[method] = with_write_preconditions(handler)
    objects.insert = with_write_preconditions(objects.insert)  # (the server's fallback route looks it up by name)
    objects.insert.like_gcs = True


@pytest.fixture(scope="session")
def s3():
    pytest.importorskip("moto.server", reason="pip install -e '.[dev]' brings moto[server]")
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.update(env)
    try:
        from traces.storage import open_store

        open_store(f"s3://{BUCKET}")[0].client.create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        _forget("s3")
        server.stop()
        _restore(old)


def _forget(scheme: str) -> None:
    """Drops the process's store for the emulator's bucket: a later emulator has another port."""
    from traces import storage

    storage._STORES.pop((scheme, BUCKET), None)


def _restore(old: dict) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def upload(local: Path, url: str) -> str:
    """Copies the run folder `local` to `url` object by object (write-if-absent); returns `url`."""
    from traces.storage import open_store

    store, key = open_store(url)
    for p in sorted(Path(local).rglob("*")):
        if p.is_file() and p.name != ".lock":
            store.write_if_absent(f"{key}/{p.relative_to(local).as_posix()}", p.read_bytes())
    return url
