"""Image URLs a request names, fetched for it: only from the hosts the operator lists.

A chat's ``image_url`` part (a Responses ``input_image``, an Anthropic ``url`` image source) may be a data URL,
which needs nothing, or an ``http(s)`` URL, which this server fetches only where ``--allowed-media-domains``
lists its host (vLLM's flag; ``*``: any host). The default lists none, so a server fetches nothing unless told
to: a fetch runs on the server's network, where it may reach what its clients cannot (a cloud's metadata
address, services on localhost). A domain allows itself and its subdomains; an IP address only itself.

A fetch gets ``--media-fetch-timeout`` seconds and at most ``image_processing.MAX_IMAGE_BYTES``; it follows up to
``MAX_REDIRECTS`` redirects, each target checked against the list again. Every failure (a host not listed, a
scheme other than http(s), a status other than 200, a timeout, a body too large) is a 400 naming the request's
field, with the URL cut short.
"""

from __future__ import annotations

import asyncio
from typing import Sequence
from urllib.parse import urljoin, urlsplit

import httpx

from hyla.server.errors import APIError
from hyla.server.protocol import DEFAULT_FETCH_TIMEOUT

MAX_REDIRECTS = 3


class MediaFetcher:
    """Fetches image URLs from the hosts ``allowed_domains`` lists (``*``: any), within ``timeout`` seconds and
    ``max_bytes`` each (default: ``image_processing.MAX_IMAGE_BYTES``; see the module's docstring)."""

    def __init__(self, allowed_domains: Sequence[str] = (), timeout: float = DEFAULT_FETCH_TIMEOUT,
                 max_bytes: int | None = None):
        if max_bytes is None:  # (imported here: the command line imports this module, and torch only to serve)
            from hyla.model.image_processing import MAX_IMAGE_BYTES
            max_bytes = MAX_IMAGE_BYTES
        domains = [d.strip().lower().rstrip(".") for d in allowed_domains]
        if any(not d or "/" in d or ":" in d and d.count(":") == 1 for d in domains):
            raise ValueError(f"--allowed-media-domains takes host names (example.com, *), got {list(allowed_domains)}")
        if not timeout > 0 or max_bytes <= 0:
            raise ValueError(f"a media fetch needs a timeout > 0 and max_bytes > 0, got {timeout}, {max_bytes}")
        self.allowed_domains, self.timeout, self.max_bytes = tuple(domains), float(timeout), int(max_bytes)

    def allows(self, url: str) -> bool:
        """Whether ``url``'s host is one the list allows (its scheme http or https)."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        if parts.scheme.lower() not in ("http", "https") or not host:
            return False
        return any(d == "*" or host == d or host.endswith("." + d) for d in self.allowed_domains)

    async def fetch_all(self, urls: Sequence[str], param: str) -> list[bytes]:
        """Each URL's bytes, fetched at once (a URL given twice, once); the first failure a 400 naming ``param``."""
        distinct = list(dict.fromkeys(urls))
        found = dict(zip(distinct, await asyncio.gather(*(self.fetch(url, param) for url in distinct))))
        return [found[url] for url in urls]

    async def fetch(self, url: str, param: str) -> bytes:
        """The bytes at ``url`` (redirects followed, each checked); a 400 naming ``param`` for any failure."""
        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                if not self.allows(url):
                    listed = "no host" if not self.allowed_domains else ", ".join(self.allowed_domains)
                    raise APIError(400, f"this server does not fetch images from {_short(url)}: --allowed-media-domains "
                                        f"lists {listed} (send the image as a data URL)", param=param)
                try:
                    async with client.stream("GET", url) as response:
                        if response.is_redirect and "location" in response.headers:
                            url = urljoin(url, response.headers["location"])
                            continue
                        if response.status_code != 200:
                            raise APIError(400, f"fetching the image {_short(url)} failed: HTTP {response.status_code}",
                                           param=param)
                        return await self._body(response, url, param)
                except httpx.HTTPError as exc:
                    raise APIError(400, f"fetching the image {_short(url)} failed ({type(exc).__name__})",
                                   param=param) from None
        raise APIError(400, f"fetching the image {_short(url)} failed: more than {MAX_REDIRECTS} redirects",
                       param=param)

    async def _body(self, response: httpx.Response, url: str, param: str) -> bytes:
        declared = response.headers.get("content-length")
        too_large = APIError(400, f"the image at {_short(url)} is larger than {self.max_bytes} bytes", param=param)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise too_large
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > self.max_bytes:
                raise too_large
        return bytes(data)


def _short(url: str, limit: int = 100) -> str:
    return repr(url if len(url) <= limit else url[:limit] + "...")
