"""What a weights URI names, where it is cached, and how a pod fetches it (pure).

The operator builds its fetch Jobs and init containers from these; the runtime parses the
same URIs. Nothing here imports a storage client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

REMOTE_SCHEMES = ("hf", "s3", "gs")
DEFAULT_HF_REVISION = "main"
# Inside the destination folder: the manifest of verified files and partial downloads.
STATE_DIR = ".tessera-fetch"

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")


class FetchFailure(IntEnum):
    """Exit codes of `tessera-runtime fetch` (2 is a bad URI, as for any bad config). The
    operator's fetch Job fails at once on the permanent ones instead of retrying."""

    BAD_URI = 2
    CREDENTIALS = 20  # the store refused the credentials (or there were none)
    NOT_FOUND = 21  # no such repository, revision, bucket, or nothing under the prefix
    VERIFY = 22  # a file did not match its checksum twice in a row
    UNREACHABLE = 23  # the store could not be reached, or answered with a server error


PERMANENT_FAILURES = (FetchFailure.BAD_URI, FetchFailure.CREDENTIALS, FetchFailure.NOT_FOUND)


class SourceError(ValueError):
    """A URI that names no fetchable checkpoint; the message says how to write one."""


@dataclass(frozen=True)
class Source:
    scheme: str  # hf | s3 | gs
    location: str  # hf: org/repo; s3/gs: the bucket
    prefix: str  # s3/gs: the folder inside the bucket ("" for the whole bucket); hf: ""
    revision: str  # hf: branch, tag or commit; s3/gs: ""

    @classmethod
    def parse(cls, uri: str) -> Source:
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in REMOTE_SCHEMES:
            raise SourceError(f"{uri!r}: a fetchable URI starts with hf://, s3:// or gs://")
        if scheme == "hf":
            repo, _, revision = rest.partition("@")
            if not _HF_REPO.match(repo):
                raise SourceError(f"{uri!r}: write hf://org/repo or hf://org/repo@revision")
            return cls("hf", repo, "", revision or DEFAULT_HF_REVISION)
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise SourceError(f"{uri!r}: write {scheme}://bucket/folder (bucket names are 3-63 "
                              "lowercase letters, digits, dots and dashes)")
        return cls(scheme, bucket, prefix.strip("/"), "")

    @property
    def uri(self) -> str:
        if self.scheme == "hf":
            return f"hf://{self.location}@{self.revision}"
        return f"{self.scheme}://{self.location}/{self.prefix}".rstrip("/")


def is_remote(uri: str) -> bool:
    return uri.partition("://")[0] in REMOTE_SCHEMES


def cache_dir(uri: str) -> str:
    """The folder, relative to a cache volume, that holds `uri`'s files: readable, and
    different for every repository, revision, bucket and prefix."""
    source = Source.parse(uri)
    if source.scheme == "hf":
        return f"hf/{source.location}@{source.revision}"
    return "/".join(part for part in (source.scheme, source.location, source.prefix) if part)


def fetch_argv(uri: str, dest: str) -> list[str]:
    """The command that fetches `uri` into `dest` in the runtime image."""
    return ["tessera-runtime", "fetch", uri, dest]
