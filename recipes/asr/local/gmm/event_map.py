"""Kaldi's decision-tree EventMap in Python and its binary ``ContextDependency`` format.

kaldi-hmm-gmm reads a tree only from Kaldi's binary blob (``ContextDependency.__setstate__``).
The writer here produces exactly the bytes Kaldi's own writer produces for the same tree:

- a token is its text and one space; an int32 is a size byte 4 then 4 little-endian bytes;
  an unsigned int32 (a table's size) has size byte -4 (0xfc);
- a vector of int32 (a split's yes-set) is a size byte 4, the count as 4 raw bytes, then the
  raw elements;
- ``ContextDependency N P ToPdf <EventMap> EndContextDependency`` where an EventMap is
  ``CE answer`` | ``TE key size ( entries... )`` (``NULL`` for a missing entry) |
  ``SE key yes_set { yes no }``.

Event keys (N=3, P=1): 0 left phone, 1 centre phone, 2 right phone, -1 pdf-class.
"""

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from local.kaldi import khg

PDF_CLASS_KEY = -1


@dataclass(frozen=True)
class Const:
    """ConstantEventMap: a leaf answering ``pdf``."""

    pdf: int


@dataclass(frozen=True)
class Split:
    """SplitEventMap: ``yes`` when the event's value for ``key`` is in ``yes_set``, else ``no``."""

    key: int
    yes_set: tuple[int, ...]
    yes: "EventMap"
    no: "EventMap"


@dataclass(frozen=True)
class Table:
    """TableEventMap: ``entries[value of key]``; ``None`` entries are undefined (Kaldi's NULL)."""

    key: int
    entries: tuple["EventMap | None", ...]


EventMap = Const | Split | Table


def map_event(node: EventMap | None, event: Mapping[int, int]) -> int | None:
    """The pdf an event (key -> value) maps to, or None where the tree has no answer."""
    while node is not None and not isinstance(node, Const):
        value = event.get(node.key)
        if value is None:
            return None
        if isinstance(node, Split):
            node = node.yes if value in node.yes_set else node.no
        else:
            node = node.entries[value] if 0 <= value < len(node.entries) else None
    return None if node is None else node.pdf


def _token(text: str) -> bytes:
    return text.encode() + b" "


def _int32(v: int) -> bytes:  # Kaldi WriteBasicType<int32>: size byte 4, little-endian
    return b"\x04" + struct.pack("<i", v)


def _write_node(node: EventMap | None) -> bytes:
    if node is None:
        return _token("NULL")
    if isinstance(node, Const):
        return _token("CE") + _int32(node.pdf)
    if isinstance(node, Split):  # yes set as Kaldi's WriteIntegerVector: size byte, count, raw ints
        vec = b"\x04" + struct.pack(f"<i{len(node.yes_set)}i", len(node.yes_set), *node.yes_set)
        return (
            _token("SE")
            + _int32(node.key)
            + vec
            + _token("{")
            + _write_node(node.yes)
            + _write_node(node.no)
            + _token("}")
        )
    # Table size is a uint32: Kaldi marks unsigned types with a negated size byte (-4 = 0xfc).
    head = _token("TE") + _int32(node.key) + b"\xfc" + struct.pack("<I", len(node.entries)) + _token("(")
    return head + b"".join(_write_node(e) for e in node.entries) + _token(")")


def write_context_dependency(root: EventMap, context_width: int = 3, central_position: int = 1) -> bytes:
    """Kaldi's binary ``ContextDependency`` blob for the tree ``root`` (as ``tree.write`` would)."""
    return (
        _token("ContextDependency")
        + _int32(context_width)
        + _int32(central_position)
        + _token("ToPdf")
        + _write_node(root)
        + _token("EndContextDependency")
    )


def parse_event_map(blob: bytes) -> tuple[int, int, EventMap]:
    """Inverse of ``write_context_dependency``: returns (context_width, central_position, root)."""
    pos = 0

    def token() -> str:
        nonlocal pos
        end = blob.index(b" ", pos)
        text, pos = blob[pos:end].decode(), end + 1
        return text

    def number(size_byte: bytes, fmt: str) -> int:
        nonlocal pos
        if blob[pos : pos + 1] != size_byte:
            raise ValueError(f"bad tree blob: expected size byte {size_byte!r} at offset {pos}")
        (v,) = struct.unpack_from(fmt, blob, pos + 1)
        pos += 5
        return v

    def node() -> EventMap | None:
        nonlocal pos
        kind = token()
        if kind == "NULL":
            return None
        if kind == "CE":
            return Const(number(b"\x04", "<i"))
        key = number(b"\x04", "<i")
        if kind == "SE":
            count = number(b"\x04", "<i")
            yes_set = struct.unpack_from(f"<{count}i", blob, pos)
            pos += 4 * count
            token()  # "{"
            yes, no = node(), node()
            token()  # "}"
            return Split(key, tuple(yes_set), yes, no)
        if kind != "TE":
            raise ValueError(f"bad tree blob: unknown EventMap token {kind!r} at offset {pos}")
        size = number(b"\xfc", "<I")
        token()  # "("
        entries = tuple(node() for _ in range(size))
        token()  # ")"
        return Table(key, entries)

    if token() != "ContextDependency":
        raise ValueError("bad tree blob: does not start with the ContextDependency token")
    width, central = number(b"\x04", "<i"), number(b"\x04", "<i")
    token()  # "ToPdf"
    root = node()
    if token() != "EndContextDependency":
        raise ValueError("bad tree blob: missing EndContextDependency")
    return width, central, root


def load_context_dependency(blob: bytes) -> "khg.ContextDependency":
    """A ``khg.ContextDependency`` read from a binary blob (pybind's pickle state is signed bytes)."""
    tree = khg.ContextDependency.__new__(khg.ContextDependency)
    tree.__setstate__(([b - 256 if b > 127 else b for b in blob],))
    return tree


def context_dependency_blob(tree: "khg.ContextDependency") -> bytes:
    """The binary blob of a ``khg.ContextDependency`` (for example Kaldi's monophone tree)."""
    return bytes(b & 0xFF for b in tree.__getstate__()[0])
