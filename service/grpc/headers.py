"""HTTP/2 header blocks for the frames engine: HPACK (the ``hpack`` library) bounded by our SETTINGS, a
decode cache for blocks that change no table, never-indexed answer blocks, and what makes a request's header
list malformed (RFC 9113 8.2-8.3)."""

from __future__ import annotations

from typing import cast

from hpack import Decoder, NeverIndexedHeaderTuple
from hpack import Encoder as _Encoder

MAX_HEADER_LIST = 16384  # decoded (RFC 7541's sizes: name + value + 32 a field): our SETTINGS, a call's bound
# A list over MAX_HEADER_LIST is still decoded up to this (HPACK's dynamic table stays in step, the stream
# alone is refused); past it the connection goes (COMPRESSION_ERROR). Every field counts at least 32 bytes,
# so this also bounds the work of decoding a block (an HPACK bomb of one-byte references stops after a few).
HARD_HEADER_LIST = 4 * MAX_HEADER_LIST
TOO_LARGE = f"a header list over {MAX_HEADER_LIST} bytes (SETTINGS_MAX_HEADER_LIST_SIZE)"
HEADER_TABLE_SIZE = 4096  # our SETTINGS_HEADER_TABLE_SIZE (the default): the peer's encoder stays within


def never_indexed(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block that leaves both HPACK tables as they were (never-indexed literals), so its bytes can
    be kept and sent again on any connection, whatever table size the peer allows."""
    encoder = _Encoder()
    return encoder.encode([NeverIndexedHeaderTuple(name, value) for name, value in headers], huffman=False)


def only_indexed(block: bytes) -> bool:
    """Whether a header block is only indexed fields of one byte each (0x81-0xfe): decoding it changes
    neither HPACK table, so its decoded headers stay valid until a block that may change the table."""
    return all(0x81 <= byte <= 0xFE for byte in block)


class CachingDecoder(Decoder):
    """``hpack.Decoder`` bounded by our SETTINGS, that keeps the decoded headers of blocks made only of
    indexed fields: a client sending the same call again sends the same bytes. Any other block may change
    the dynamic table (its indices shift), so it empties the cache."""

    def __init__(self) -> None:
        super().__init__(max_header_list_size=HARD_HEADER_LIST)
        self.max_allowed_table_size = HEADER_TABLE_SIZE
        self.cache: dict[bytes, tuple[list[tuple[bytes, bytes]], str | None]] = {}

    def decode_raw(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """A header block's list, names and values as bytes (what ``decode(raw=True)`` gives)."""
        return cast(list[tuple[bytes, bytes]], self.decode(data, raw=True))

    def decode_checked(self, data: bytes, trailers: bool) -> tuple[list[tuple[bytes, bytes]], str | None]:
        """A header list and what is wrong with it (None: nothing): ``TOO_LARGE`` (that very object) for a
        list over ``MAX_HEADER_LIST``, else what is malformed in it."""
        headers = self.decode_raw(data)
        if sum(len(name) + len(value) for name, value in headers) + 32 * len(headers) > MAX_HEADER_LIST:
            return headers, TOO_LARGE
        return headers, malformed(headers, trailers)

    def decode_request(self, data: bytes) -> tuple[list[tuple[bytes, bytes]], str | None]:
        """A request's header list (names and values as bytes) and what is wrong with it (None: nothing,
        ``decode_checked``), both kept for a block of indexed fields only."""
        key = bytes(data)
        known = self.cache.get(key)
        if known is not None:
            return known
        result = self.decode_checked(key, trailers=False)
        if only_indexed(key):
            if len(self.cache) >= 64:
                self.cache.clear()
            self.cache[key] = result
        else:
            self.cache.clear()
        return result


_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
_REQUIRED_PSEUDO = frozenset((b":method", b":scheme", b":path"))


def malformed(headers: list[tuple[bytes, bytes]], trailers: bool) -> str | None:
    """What makes a request's (or its trailers') header list malformed (RFC 9113 8.2, 8.3), None if nothing:
    pseudo-headers first, known, once each, the required ones present (none in trailers); names in lower
    case; no connection-specific header (``te`` only as ``trailers``)."""
    seen: set[bytes] = set()
    regular = False
    for name, value in headers:
        if name[:1] == b":":
            if trailers or regular:
                return "a pseudo-header in trailers or after a regular header"
            if name not in _REQUEST_PSEUDO or name in seen:
                return "an unknown or repeated pseudo-header"
            seen.add(name)
            continue
        regular = True
        if name != name.lower():
            return "a header name in upper case"
        if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            return "a connection-specific header"
    if not trailers and not seen >= _REQUIRED_PSEUDO:
        return "a request without :method, :scheme and :path"
    return None
