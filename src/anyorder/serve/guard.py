"""Checks on raw HTTP requests to ``anyorder serve``, before any of them reaches the model.

The page is meant for the machine it runs on, and a browser on that machine also runs
other sites' scripts. These checks keep those scripts out:

* **Host**: a DNS-rebinding page reaches ``127.0.0.1`` under its own name
  (``evil.example``), so the Host header names a domain. Only ``localhost``, loopback
  addresses and the address the server was told to listen on are accepted; a server bound
  to every interface (``0.0.0.0``/``::``) also accepts any IP literal (rebinding needs a
  name, and ``--host 0.0.0.0`` asked for other machines).
* **Origin**: a cross-site form or ``fetch`` carries its page's Origin; only an absent one
  (not a browser, or a same-origin GET) or the server's own (``http://`` + Host) is taken.
* **Content-Type**: POST bodies must be ``application/json``; a cross-site "simple"
  request can only send ``text/plain`` or form types without asking the server first.
* **One of each**: a second Host, Origin, Content-Length, Content-Type or
  Transfer-Encoding header is refused, not resolved by taking the first (the parts of a
  chain may each take a different one).
* **Content-Length**: ASCII digits only (``'²'.isdigit()`` is True in Python), with only
  spaces and tabs around them (``+5``, ``0x5``, ``5, 5`` are refused); no chunked bodies. A
  length of more digits than any body the server takes is a body too large (413), not a
  missing length.
* **Header lines**: at most :data:`MAX_HEADER_LINES`, counted here (:func:`parse_headers`):
  :mod:`http.client` counts the blank line that ends them among its 100, so it refused
  exactly 100. Each must be ``Name: value``: the email parser http.server uses takes the
  first line that is not (``Name : value``, a folded line) as the start of the body, so
  every header after it would go unseen by these checks.
* **Content-Encoding**: only identity; a compressed body is refused by name (415), not read
  as text. **UTF-8**: a body that is not (UTF-16 or Latin-1 text) is named so, with the
  charset its Content-Type names.
* **Strict JSON**: ``NaN``/``Infinity`` (not JSON, though Python reads them) and a field
  named twice (which Python resolves by taking the last) are refused.
* **JSON depth**: a request is one flat object; deeper nesting than :data:`MAX_JSON_DEPTH`
  is refused before ``json.loads`` (whose recursion a 30,000-deep body exhausts).
"""

from __future__ import annotations

import email.message
import email.parser
import ipaddress
import json
import re
from typing import Any

from anyorder.errors import SamplingError

MAX_JSON_DEPTH = 4
"""Deepest nesting of arrays and objects a request body may have."""
LOOPBACK_NAMES = ("localhost",)
SINGLE = ("Host", "Origin", "Content-Length", "Content-Type", "Transfer-Encoding")
"""Headers a request may carry once at most."""
PREVIEW = 80
"""Characters of a client's value quoted in an answer."""
MAX_HEADER_LINES = 100
"""Most header lines a request may have; more get 431."""
TOO_LONG = 10**18
"""What :func:`content_length` returns for a length of more than 18 digits: over any limit."""
_LENGTH = re.compile(r"[0-9]+")
_FIELD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:")  # a token (RFC 9110), then the colon
_OWS = " \t"
_HOST = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::(?P<port>[0-9]{1,5}))?$"
)


def preview(value: str | None, limit: int = PREVIEW) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length named."""
    if value is None or len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def cut(text: str, limit: int = PREVIEW) -> str:
    """A client's path, method or number, cut for an answer (unquoted, unlike :func:`preview`)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def repeated(headers: Any) -> str | None:
    """The first of :data:`SINGLE` that ``headers`` (an :class:`email.message.Message`)
    holds more than once, or None."""
    for name in SINGLE:
        if len(headers.get_all(name) or ()) > 1:
            return name
    return None


def host_name(header: str | None) -> str | None:
    """The host part of a Host header (``[::1]:8000`` -> ``::1``), lower case, or None when
    it is malformed."""
    if not header:
        return None
    m = _HOST.match(header.strip())
    if m is None:
        return None
    return (m.group("v6") or m.group("name")).lower()


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_allowed(header: str | None, bound: str) -> bool:
    """Whether a request's Host header names this server (see the module notes).

    Args:
        header: the Host header (None when absent: refused).
        bound: the address the server listens on (``--host``).
    """
    name = host_name(header)
    if name is None:
        return False
    ip = _ip(name)
    if name in LOOPBACK_NAMES or (ip is not None and ip.is_loopback):
        return True
    if name == bound.strip("[]").lower():
        return True
    if ip is None:  # a name other than ours: DNS rebinding, or a typo
        return False
    wildcard = _ip(bound.strip("[]")) if bound else None
    return not bound or (wildcard is not None and wildcard.is_unspecified)


def origin_allowed(origin: str | None, host_header: str | None) -> bool:
    """An absent Origin, or the server's own (``http://`` + the Host header)."""
    if origin is None:
        return True
    return host_header is not None and origin.strip().lower() == f"http://{host_header}".lower()


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is ``application/json`` (parameters such as charset allowed)."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def body_refusal(headers: Any) -> Refusal | None:
    """Why a POST body cannot be read, before it is (415), or None: a Content-Type that is
    not JSON, or a Content-Encoding other than identity (a gzip body read as text was "not
    JSON", which said nothing of the compression)."""
    if not is_json(headers.get("Content-Type")):
        return Refusal(415, "send the body as JSON with Content-Type: application/json")
    codings = [c.strip() for v in headers.get_all("Content-Encoding") or () for c in v.split(",")]
    other = [c for c in codings if c and c.lower() != "identity"]
    if other:
        return Refusal(
            415,
            f"the body is sent with Content-Encoding {cut(', '.join(other))}, which this server "
            "does not read; send the body uncompressed (no Content-Encoding header)",
        )
    return None


def body_text(raw: bytes, content_type: str | None) -> str:
    """The body as text: JSON is UTF-8 (RFC 8259), and a NUL byte is in no JSON text but in
    every UTF-16 or UTF-32 one of ASCII characters (so one without a BOM is named too). One
    leading UTF-8 byte-order mark (U+FEFF, as Windows tools write) is dropped: RFC 8259
    lets a parser ignore it, and ``json.loads`` called it "not JSON".

    Raises:
        SamplingError: naming the first byte that is not UTF-8 JSON, and a charset other
            than UTF-8 that the Content-Type names.
    """
    nul = raw.find(b"\x00")
    try:
        text = raw.decode("utf-8")
        at = nul
    except UnicodeDecodeError as e:
        at = e.start if nul < 0 else min(nul, e.start)
    if at < 0:
        return text.removeprefix("\ufeff")
    what = f"byte 0x{raw[at]:02x} at offset {at}"
    if raw[at] == 0:
        what = f"a NUL byte at offset {at}, as UTF-16 and UTF-32 text hold"
    message = email.message.Message()
    message["Content-Type"] = content_type or ""
    charset = message.get_content_charset()
    if charset in (None, "utf-8", "utf8"):
        raise SamplingError(f"the body is not UTF-8 ({what}); send the JSON body in UTF-8")
    raise SamplingError(
        f"the body is not UTF-8 ({what}) and its Content-Type names charset={cut(charset)}; "
        "this server reads UTF-8 JSON only: send the body in UTF-8 (charset=utf-8)"
    )


def content_length(value: str | None) -> int | None:
    """The Content-Length as an int (:data:`TOO_LONG` past 18 digits), or None when it is
    absent or not ASCII digits between optional spaces and tabs."""
    digits = None if value is None else value.strip(_OWS)
    if digits is None or not _LENGTH.fullmatch(digits):
        return None
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else TOO_LONG


class Refusal(SamplingError):
    """A request refused with the HTTP ``status`` given."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def header_lines(rfile: Any) -> list[bytes]:
    """The header lines at ``rfile``, read up to (and past) the blank line that ends them."""
    lines = []
    while (line := rfile.readline()) not in (b"\r\n", b"\n", b""):
        lines.append(line)
    return lines


def parse_headers(lines: list[bytes], message_class: Any) -> Any:
    """``lines`` (:func:`header_lines`) parsed as :func:`http.client.parse_headers` does.

    Raises:
        Refusal: more than :data:`MAX_HEADER_LINES` (431), or a line that is not
            ``Name: value`` (400).
    """
    if len(lines) > MAX_HEADER_LINES:
        n, most = len(lines), MAX_HEADER_LINES
        raise Refusal(431, f"the request has {n} header lines; send at most {most}")
    for i, line in enumerate(lines, 1):
        if not _FIELD.match(line):
            shown = preview(line.decode("iso-8859-1").rstrip("\r\n"))
            raise Refusal(400, f"header line {i} ({shown}) is not Name: value; send one per line")
    text = b"".join(lines).decode("iso-8859-1") + "\r\n"
    return email.parser.Parser(_class=message_class).parsestr(text)


def page_url(bound: str, port: int) -> str:
    """Where a client should open the page: the address the server listens on (a loopback
    address when that is every interface), with brackets for IPv6."""
    host = bound.strip("[]") or "127.0.0.1"
    ip = _ip(host)
    if ip is not None and ip.is_unspecified:
        host = "::1" if ip.version == 6 else "127.0.0.1"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``raw`` nests arrays/objects deeper than ``limit`` (brackets inside strings do
    not count). Linear in the body, which the server's size limit bounds."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth, in_str, escaped = 0, False, False
    for b in raw:
        if in_str:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:  # quote
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif b in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False


def _no_constant(name: str) -> Any:
    raise SamplingError(f"{name} is not a JSON number; send a finite number")


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SamplingError(f"the body names the field {preview(key)} twice; send it once")
        out[key] = value
    return out


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``/``Infinity`` and repeated keys
    (:class:`~anyorder.errors.SamplingError`); other faults raise ``ValueError`` as usual."""
    return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_once)
