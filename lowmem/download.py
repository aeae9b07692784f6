"""Downloads that fail fast when offline: the one network helper of lowmem and its scripts."""

from __future__ import annotations

import hashlib
import http.client
import threading
import urllib.request
from pathlib import Path


def fetch(url: str, destination: Path, timeout_s: float) -> str:
    """Stream ``url`` into ``destination`` and return the MD5 of the bytes received.

    The request runs in a thread joined with a deadline, because name lookups ignore socket
    timeouts: an offline machine fails here within ``timeout_s``, before any long transfer starts.
    Once the server has answered, ``timeout_s`` bounds every read.
    """
    responses: list[http.client.HTTPResponse] = []
    errors: list[BaseException] = []

    def request() -> None:
        try:
            responses.append(urllib.request.urlopen(url, timeout=timeout_s))
        except Exception as error:  # handed over to the caller's thread below
            errors.append(error)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    if not responses:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    digest = hashlib.md5()
    with responses[0] as response, open(destination, "wb") as file:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            file.write(chunk)
    return digest.hexdigest()


def file_md5(path: Path) -> str:
    """MD5 of a file on disk, read in 1 MiB chunks (to check an archive already downloaded)."""
    digest = hashlib.md5()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
