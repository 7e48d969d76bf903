"""The compiled-grammar cache: least recently used first out, bounded by the bytes its entries are charged.

A count of entries bounds nothing: one 1.4 MB enum schema compiles to ~26 MB, so 256 of them held ~6.7 GB until
the server restarted. Each entry here carries the bytes ``limits.charge`` counts it as, and adding one drops the
least recently used until the total fits the budget again. Not thread-safe: ``GrammarCompiler`` holds its lock
around every call.
"""

from collections import OrderedDict


class GrammarCache:
    """Compiled constraints by key, at most ``budget`` charged bytes in all."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0  # the entries' charges, summed
        self._entries: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (compiled, charge)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> object | None:
        """The entry of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: object, charge: int) -> None:
        """Keep ``value`` under ``key``, charged ``charge`` bytes, dropping the least recently used entries until
        the total fits; one larger than the whole budget is not kept."""
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        if charge > self.budget:
            return
        self._entries[key] = (value, charge)
        self.bytes += charge
        while self.bytes > self.budget:
            self.bytes -= self._entries.popitem(last=False)[1][1]


__all__ = ["GrammarCache"]
