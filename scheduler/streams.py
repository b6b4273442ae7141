"""Entries appended to a capped stream in one command.

The scheduler writes an event and a status-history entry for every GPU that changes state; at a phase end that is
a thousand of each in one tick. One XADD each costs the client more than the entries' encoding, so a tick's
entries for one stream go in one script call, each appended as `XADD key MAXLEN ~ maxlen * data <payload>` would
append it (in order, trimmed the same way).
"""

from __future__ import annotations

from typing import Any

# KEYS: the stream. ARGV: maxlen, then each entry's payload (field 'data'). Returns the number appended.
_XADD_MANY = """
for j = 2, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'data', ARGV[j])
end
return #ARGV - 1
"""


class StreamAppender:
    """Queues `data` entries per stream; `flush` appends each stream's entries with one command."""

    def __init__(self, r: Any, maxlen: int) -> None:
        self._script = r.register_script(_XADD_MANY)
        self.maxlen = maxlen
        self.pending: dict[str, list[bytes]] = {}

    def add(self, stream: str, data: bytes) -> None:
        self.pending.setdefault(stream, []).append(data)

    def flush(self, client: Any) -> None:
        """Queue every stream's entries on `client` (a pipeline), one call per stream; forget them."""
        for stream, entries in self.pending.items():
            if len(entries) == 1:  # a plain XADD: the usual tick, and the same command as before batching
                client.xadd(stream, {"data": entries[0]}, maxlen=self.maxlen, approximate=True)
            else:
                self._script(keys=[stream], args=[self.maxlen, *entries], client=client)
        self.pending = {}

    def drop(self) -> None:
        self.pending = {}
