"""``s3://bucket/prefix`` registries (optional: needs boto3, ``pip install -e .[s3]``)."""

from __future__ import annotations

from typing import Any

from registry.errors import (
    StoreConflictError,
    StoreError,
    StoreNotFoundError,
    StoreTransientError,
)
from registry.names import CHUNK_PREFIX
from registry.stores.base import RangeReader, safe_key
from registry.transfer import Deadline


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise StoreError(
            "s3:// registries need boto3, which is not installed: pip install 'edgetrain[s3]' "
            "(or pip install boto3)"
        ) from None
    return boto3


class _S3Range:
    def __init__(self, body: Any, size: int) -> None:
        self._body = body
        self.size = size

    def readinto(self, buf: memoryview) -> int:
        try:
            data = self._body.read(len(buf))
        except Exception as e:  # botocore/urllib3 raise many unrelated types mid-stream
            raise StoreTransientError(f"S3 read failed: {type(e).__name__}: {e}") from None
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()


class S3Store:
    """``s3://bucket/prefix``; credentials and endpoint come from boto3's usual sources
    (environment, ~/.aws, instance role; AWS_ENDPOINT_URL for MinIO or other S3-compatibles)."""

    def __init__(self, bucket: str, prefix: str = "", client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = client if client is not None else _boto3().client("s3")

    def _key(self, key: str) -> str:
        key = safe_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, e: Exception, key: str) -> StoreError:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(e, ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = e.response.get("Error", {}).get("Code", "")
            where = f"s3://{self.bucket}/{self._key(key)}"
            if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
                return StoreNotFoundError(f"{where} does not exist")
            if status == 412:  # If-None-Match: * and the key exists
                return StoreConflictError(f"{where} exists; objects are never overwritten")
            # 409 ConditionalRequestConflict: a conditional write to the key is in flight.
            if status >= 500 or status in (409, 429) or code in ("SlowDown", "Throttling"):
                return StoreTransientError(f"{where}: {code or status}")
            return StoreError(f"{where}: {code or status}: {e}")
        if isinstance(e, BotoCoreError):
            return StoreTransientError(f"S3 request failed: {e}")
        return StoreTransientError(f"S3 request failed: {type(e).__name__}: {e}")

    def exists(self, key: str, deadline: Deadline | None = None) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            err = self._error(e, key)
            if isinstance(err, StoreNotFoundError):
                return False
            raise err from None

    def get(self, key: str, max_bytes: int, deadline: Deadline | None = None) -> bytes | None:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = resp["Body"].read(max_bytes + 1)
        except Exception as e:
            err = self._error(e, key)
            if isinstance(err, StoreNotFoundError):
                return None
            raise err from None
        if len(data) > max_bytes:
            where = f"s3://{self.bucket}/{self._key(key)}"
            raise StoreError(f"{where} is over the {max_bytes}-byte limit for this object")
        return data

    def put(self, key: str, data: bytes, deadline: Deadline | None = None) -> None:
        # Chunks and manifests are never replaced: S3 refuses the write if the key exists (a
        # bucket policy can require it, see the README). A signature may be written again: an
        # interrupted upload leaves one without its manifest; the counter moves on.
        chunk = key.startswith(CHUNK_PREFIX + "/")
        once = {"IfNoneMatch": "*"} if chunk or key.endswith("/manifest.json") else {}
        try:  # an S3 PUT is atomic: the object appears whole or not at all
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **once)
        except Exception as e:
            err = self._error(e, key)
            if chunk and isinstance(err, StoreConflictError):
                return  # content-addressed: the chunk is there (its hash is checked on pull)
            raise err from None

    def close(self) -> None:
        pass

    def open_range(self, key: str, start: int, deadline: Deadline | None = None) -> RangeReader:
        try:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-"
            )
        except Exception as e:
            raise self._error(e, key) from None
        content_range = resp.get("ContentRange")  # "bytes 10-99/100"
        size = int(content_range.rsplit("/", 1)[1]) if content_range else int(resp["ContentLength"])
        return _S3Range(resp["Body"], size)
