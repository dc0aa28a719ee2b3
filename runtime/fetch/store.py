"""s3:// and gs:// through obstore: listing with ETags, ranged reads, errors as FetchError.

obstore (Apache-2.0/MIT) speaks both stores and reads its configuration from the
environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
AWS_ENDPOINT_URL (an S3-compatible store), AWS_ALLOW_HTTP; GOOGLE_SERVICE_ACCOUNT_KEY (the
key's JSON) or GOOGLE_APPLICATION_CREDENTIALS (a file); with none set, the node's or the
workload's identity. s3fs would need botocore, whose python-dateutil<3 pin cannot be
installed beside the operator's kubernetes client (python-dateutil>=3).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import obstore
from obstore.exceptions import (
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from tessera.runtime.fetch.download import CHUNK_BYTES, FetchError, describe
from tessera.runtime.fetch.source import FetchFailure, Source
from tessera.runtime.fetch.verify import RemoteFile, from_etag

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_CREDENTIALS_HINT = ("check the Secret named in weights.credentialsSecret (its access key, "
                     "secret and, for a compatible store, AWS_ENDPOINT_URL)")


def _open(source: Source) -> Any:
    if source.scheme == "s3":
        from obstore.store import S3Store
        return S3Store(source.location)
    from obstore.store import GCSStore
    return GCSStore(source.location)


def store_error(source: Source, error: BaseException) -> FetchError:
    """One line naming the bucket and the cause, with the exit code of its class."""
    text = describe(error)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    why = " ".join(x for x in (status and f"HTTP {status.group(1)}", code and code.group(1))
                   if x) or text[:300]
    bucket = f"{source.scheme}://{source.location}"
    if isinstance(error, (UnauthenticatedError, PermissionDeniedError)) or (
            status and status.group(1) in ("401", "403")):
        return FetchError(FetchFailure.CREDENTIALS,
                          f"{bucket}: the store refused the credentials ({why}); "
                          f"{_CREDENTIALS_HINT}")
    if isinstance(error, (NotFoundError, FileNotFoundError)) or (
            status and status.group(1) == "404"):
        return FetchError(FetchFailure.NOT_FOUND,
                          f"{bucket}: not found ({why}); check the bucket and folder in "
                          "weights.uri")
    return FetchError(FetchFailure.UNREACHABLE, f"{bucket}: the store failed ({why})")


class ObjectStore:
    """The fetch's Store for one s3:// or gs:// source."""

    def __init__(self, source: Source) -> None:
        self.source = source
        try:
            self._store = _open(source)
        except Exception as e:  # a configuration the client refuses (e.g. a bad endpoint)
            raise FetchError(FetchFailure.CREDENTIALS,
                             f"{source.scheme}://{source.location}: cannot configure the "
                             f"client: {describe(e)}") from None
        self._prefix = f"{source.prefix}/" if source.prefix else ""

    def list(self) -> list[RemoteFile]:
        try:
            batches = obstore.list(self._store, prefix=self.source.prefix or None)
            metas = [meta for batch in batches for meta in batch]
        except Exception as e:
            raise store_error(self.source, e) from None
        return [from_etag(meta["path"].removeprefix(self._prefix), int(meta["size"]),
                          meta.get("e_tag")) for meta in metas
                if not meta["path"].endswith("/")]

    def read(self, path: str, offset: int) -> Iterator[bytes]:
        key = self._prefix + path
        try:
            options: Any = {"range": {"offset": offset}} if offset else None
            result = obstore.get(self._store, key, options=options)
            for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
                yield bytes(chunk)
        except FetchError:
            raise
        except Exception as e:
            raise store_error(self.source, e) from None
