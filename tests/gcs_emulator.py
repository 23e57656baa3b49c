"""A Google Cloud Storage emulator for tests: `serve` starts gcp-storage-emulator on a free
loopback port with one bucket, points every client this project reads gs:// with at it, and
yields the bucket's gs:// root.

What points each client at the emulator (no client falls back to a local path; one not
pointed at it tries storage.googleapis.com and fails or hangs offline):
* gcsfs (etils.epath's gs:// backend when TensorFlow is absent, as here; TensorBoard's fsspec
  files; `listing`): STORAGE_EMULATOR_HOST, an anonymous token, and
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (otherwise gcsfs asks the Storage Control gRPC API,
  which the emulator lacks, for every bucket's layout: a 60 s timeout each);
* tensorstore (Orbax's arrays): TENSORSTORE_GCS_HTTP_URL, GOOGLE_AUTH_TOKEN_FOR_TESTING;
* google-cloud-cpp inside array_record (ArrayRecord readers of gs:// paths):
  CLOUD_STORAGE_EMULATOR_ENDPOINT.

The emulator sends no x-goog-generation header with an object's bytes, as GCS does; tensorstore
then reads generation 0, and the conditional write of an OCDBT manifest (Orbax's checkpoints)
fails with "Malformed StorageGeneration". `serve` adds the header. The emulator does not check
write preconditions (ifGenerationMatch) at all: enough for one writing process, as here.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import sys
from collections.abc import Iterator
from http import HTTPStatus

import pytest

BUCKET = "sbd-test-bucket"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _forget_filesystems() -> None:
  """Drops the gcsfs filesystems made so far (each keeps the endpoint it was made with)."""
  import gcsfs
  from etils.epath import backend

  gcsfs.core.GCSFileSystem.clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()


def _with_generation(download):
  """The emulator's object download, with the generation headers GCS sends."""

  def handler(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      response["x-goog-generation"] = obj["generation"]
      response["x-goog-metageneration"] = obj["metageneration"]

  return handler


def _patch_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
  """Generation headers on downloads; no traceback for a reader that hangs up early."""
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects

  report = http.server.HTTPServer.handle_error

  def handle_error(self, request, client_address):
    if not isinstance(sys.exc_info()[1], ConnectionError):  # a ranged read closed early
      report(self, request, client_address)

  monkeypatch.setattr(http.server.HTTPServer, "handle_error", handle_error)  # the emulator's

  original = objects.download
  download = _with_generation(original)
  monkeypatch.setattr(objects, "download", download)  # ?alt=media reads call it by this name
  for _, methods in server.HANDLERS:
    if methods.get(server.GET) is original:
      monkeypatch.setitem(methods, server.GET, download)


@contextlib.contextmanager
def serve(monkeypatch: pytest.MonkeyPatch, bucket: str = BUCKET) -> Iterator[str]:
  """An emulated bucket, as "gs://<bucket>", for the duration of the block."""
  from gcp_storage_emulator.server import create_server

  _patch_emulator(monkeypatch)
  port = _free_port()
  server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
  server.start()
  url = f"http://127.0.0.1:{port}"
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
  monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
  monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
  monkeypatch.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", url)
  import fsspec
  import gcsfs

  monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})
  # The plain filesystem even if gcsfs was imported before the variable above was set.
  registry = sys.modules["fsspec.registry"]._registry
  for protocol in ("gs", "gcs"):
    monkeypatch.setitem(registry, protocol, gcsfs.core.GCSFileSystem)
  monkeypatch.setattr(logging.getLogger("gcp_storage_emulator"), "disabled", True)  # 404 noise
  _forget_filesystems()
  try:
    yield f"gs://{bucket}"
  finally:
    _forget_filesystems()
    server.stop()


def listing(url: str) -> list[str]:
  """Every object under the gs:// `url`, as paths relative to it, as the emulator lists them."""
  import gcsfs

  root = url.removeprefix("gs://").rstrip("/")
  return sorted(p[len(root) + 1 :] for p in gcsfs.core.GCSFileSystem(token="anon").find(root))


def download(url: str, local_dir) -> str:
  """A local copy of the objects under the gs:// `url`, fetched by a filesystem made for the
  call (no listing cached by an earlier read or write is used); returns the local directory."""
  import gcsfs

  fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)
  fs.get(url.removeprefix("gs://").rstrip("/") + "/", f"{local_dir}/", recursive=True)
  return str(local_dir)
