"""Everything hfpatch replaces is one kind of record, a :class:`Patch`: a class, an attribute of its own,
what it was, and what replaces it (a class's ``forward``, a companion's, a receiver's method, a rotary
class's ``forward``, a descriptor, a cache layer's ``__init__``). An adapter's rows are built when its
class is patched (:mod:`hfpatch.build`); the :class:`Ledger` installs them in one loop (a ``late`` row,
one only a packed call needs, at the first such call) and reverts them in one loop that checks
identity, counting the adapters that share a row (a rotary class of their module, the cache layer): a
row is undone with its last user. As in wrapt's ``patches.py``, attributes are read from the class's own
``__dict__``, so nothing is bound or inherited by mistake."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ._context import Pin, Users

__all__ = ["ABSENT", "Ledger", "Patch"]


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()  # the class had no attribute of its own by that name: revert deletes ours


class Patch(NamedTuple):
    """One replaced class attribute (or an entry of a namespace: a modeling module's attention
    functions)."""

    owner: Any  # a class, or a dict
    attribute: str
    original: Any  # the class's own value before (``ABSENT``: none of its own)
    replacement: Any
    users: Optional[Users] = None  # who shares it, for a replacement that reads that (rotary classes)
    late: bool = False  # installed at the first call that needs it, not with the others

    @property
    def key(self) -> tuple[Any, str]:
        return (self.owner if isinstance(self.owner, type) else id(self.owner)), self.attribute

    def current(self) -> Any:
        return _namespace(self.owner).get(self.attribute, ABSENT)

    def put(self, value: Any) -> None:
        """Set the attribute (an entry of a namespace: a module's functions) to ``value``."""
        if isinstance(self.owner, dict):
            self.owner[self.attribute] = value
        else:
            type.__setattr__(self.owner, self.attribute, value)

    def remove(self) -> None:
        if isinstance(self.owner, dict):
            del self.owner[self.attribute]
        else:
            type.__delattr__(self.owner, self.attribute)


def _namespace(owner: Any) -> Any:
    return owner if isinstance(owner, dict) else owner.__dict__


class Ledger:
    """The installed rows, each with the adapters that use it. Not thread-safe by itself: the engine
    calls it under its lock."""

    def __init__(self) -> None:
        self._rows: dict[tuple[type, str], tuple[Patch, tuple[Pin, ...]]] = {}

    def stale(self, rows: tuple[Patch, ...]) -> bool:
        """Whether some row no longer matches its class (the attribute changed since the rows were built,
        and not by an installed row of this ledger): they must be built again."""
        for row in rows:
            installed = self._rows.get(row.key)
            expected = installed[0].replacement if installed is not None else row.original
            if row.current() is not expected:
                return True
        return False

    def shared(self, rows: tuple[Patch, ...]) -> tuple[Patch, ...]:
        """``rows`` as built, except those built over a row installed now (their ``original`` is its
        replacement): the installed row itself, which they share, so that no row wraps another one's
        replacement or puts it back at revert."""
        found = []
        for row in rows:
            installed = self._rows.get(row.key)
            found.append(
                installed[0] if installed is not None and row.original is installed[0].replacement else row
            )
        return tuple(found)

    def install(self, pin: Pin, rows: tuple[Patch, ...], late: bool = False) -> list[Patch]:
        """Install ``rows`` for the adapter of ``pin`` (its ``late`` rows alone with ``late=True``, else
        the others); a row another adapter installed is shared. Returns the rows set on their classes
        now."""
        done = []
        for row in rows:
            if row.late is not late:
                continue
            installed = self._rows.get(row.key)
            if installed is not None:
                kept, users = installed
                if pin not in users:
                    self._rows[row.key] = (kept, (*users, pin))
                    _publish(kept, (*users, pin))
                continue
            row.put(row.replacement)
            self._rows[row.key] = (row, (pin,))
            _publish(row, (pin,))
            done.append(row)
        return done

    def revert(self, pin: Pin, rows: tuple[Patch, ...]) -> list[Patch]:
        """The adapter of ``pin`` stops using ``rows``; a row without users is undone, unless someone
        replaced it after us (theirs then stays). Returns the rows undone on their classes."""
        undone = []
        for row in rows:
            installed = self._rows.get(row.key)
            if installed is None or pin not in installed[1]:
                continue
            kept, users = installed
            users = tuple(user for user in users if user is not pin)
            _publish(kept, users)
            if users:
                self._rows[row.key] = (kept, users)
                continue
            del self._rows[row.key]
            if kept.current() is kept.replacement:
                if kept.original is ABSENT:
                    kept.remove()
                else:
                    kept.put(kept.original)
                undone.append(kept)
        return undone

    def installed_by(self, pin: Pin) -> tuple[Patch, ...]:
        """The installed rows ``pin``'s adapter uses."""
        return tuple(row for row, users in self._rows.values() if pin in users)

    def installed(self) -> list[Patch]:
        """Every row installed now, in the order installed."""
        return [row for row, _ in self._rows.values()]


def _publish(row: Patch, users: tuple[Pin, ...]) -> None:
    if row.users is not None:
        row.users.pins = users
