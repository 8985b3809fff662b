"""Names and short ids where a command takes an id, as `gh`, `kubectl` and `docker` do.

A reference is resolved against the things the command could mean (the project's allocations, the
instance's members, ...), in this order: the full id; an exact name (or another exact key, e.g. an email);
a unique prefix of the id (dashes ignored). Two names or two prefixes that fit are an error listing the
candidates, never a guess. Tables show `short_id`s: the shortest prefix (8 characters at least) that tells
the listed things apart, so what a table shows is what the commands accept. Ids are UUIDv7 (time first):
the first 8 characters of ids made in the same minute are often alike, which is why a short id grows
until it is unique instead of being cut at a fixed length.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
MIN_SHORT = 8


class Unresolved(Exception):
    """A reference that names nothing, or more than one thing (the CLI prints it and exits 1)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def _hex(value: Any) -> str:
    return str(value).replace("-", "").lower()


def is_uuid(ref: str) -> bool:
    try:
        uuid.UUID(ref)
    except ValueError:
        return False
    return True


def short_ids(ids: Iterable[Any]) -> dict[str, str]:
    """Each id (as text) -> its shortest prefix of at least 8 characters that no other id of `ids` shares."""
    texts = sorted({str(i) for i in ids})
    out: dict[str, str] = {}
    for i, text in enumerate(texts):
        common = 0
        for other in (texts[i - 1] if i else None, texts[i + 1] if i + 1 < len(texts) else None):
            if other is None:
                continue
            n = 0
            while n < min(len(text), len(other)) and text[n] == other[n]:
                n += 1
            common = max(common, n)
        length = max(MIN_SHORT, common + 1)
        # never end on a dash: the next character is what tells them apart
        while length < len(text) and text[length - 1] == "-":
            length += 1
        out[text] = text[:length]
    return out


@dataclass
class Candidate:
    id: str
    label: str  # what the ambiguity error shows next to the id (the name, the email, ...)
    keys: tuple[str, ...]  # exact names that also resolve to it


def resolve(
    kind: str,
    ref: str,
    items: Sequence[T],
    *,
    id_of: Callable[[T], Any],
    names: Callable[[T], Iterable[Any]],
) -> T:
    """The one item of `items` that `ref` names (see the module's rules), else Unresolved."""
    ref = ref.strip()
    if not ref:
        raise Unresolved("invalid_reference", f"no {kind} given")
    cands: list[tuple[T, Candidate]] = []
    for item in items:
        keys = tuple(str(n) for n in names(item) if n)
        cands.append((item, Candidate(str(id_of(item)), keys[0] if keys else "", keys)))
    for item, c in cands:
        if c.id == ref or (is_uuid(ref) and uuid.UUID(ref) == uuid.UUID(c.id)):
            return item
    named = [(item, c) for item, c in cands if ref in c.keys]
    if not named:  # names are case-sensitive, emails are not
        named = [(item, c) for item, c in cands if any(k.lower() == ref.lower() and "@" in k for k in c.keys)]
    if len(named) == 1:
        return named[0][0]
    if len(named) > 1:
        raise Unresolved("ambiguous_reference", _ambiguous(kind, ref, [c for _, c in named], "name"))
    prefix = _hex(ref)
    if len(prefix) >= 1 and all(ch in "0123456789abcdef" for ch in prefix):
        matches = [(item, c) for item, c in cands if _hex(c.id).startswith(prefix)]
        if len(matches) == 1:
            return matches[0][0]
        if len(matches) > 1:
            raise Unresolved("ambiguous_reference", _ambiguous(kind, ref, [c for _, c in matches], "id prefix"))
    raise Unresolved("not_found", f"no {kind} named {ref!r} (a name, an id or a unique id prefix)")


def _ambiguous(kind: str, ref: str, cands: list[Candidate], what: str) -> str:
    shorts = short_ids(c.id for c in cands)
    listed = "; ".join(f"{shorts[c.id]} {c.label}".rstrip() for c in cands[:10])
    more = f" and {len(cands) - 10} more" if len(cands) > 10 else ""
    return f"{what} {ref!r} fits {len(cands)} {kind}s: {listed}{more}; give more of the id"
