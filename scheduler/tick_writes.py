"""A tick's batched writes: stream entries and string values queued while the tick decides, written at its end
with a few commands, whatever the number of GPUs they concern.

The scheduler writes an event and a status-history entry for every GPU that changes state, and a final record for
every session that ends; at a phase end that is a thousand of each in one tick. One command each costs the client
more than the payloads' encoding, so a tick's entries for one stream go in one script call, each appended as
`XADD key MAXLEN ~ maxlen * data <payload>` would append it (in order, trimmed the same way), and its string values
in one MSET.
"""

from __future__ import annotations

from typing import Any

from tailspec.scheduler.leases import call_script

# KEYS: the stream. ARGV: maxlen, then each entry's payload (field 'data'). Returns the number appended.
_XADD_MANY = """
for j = 2, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'data', ARGV[j])
end
return #ARGV - 1
"""


class TickWrites:
    """Queues `data` entries per stream and string values; `flush` queues them on the tick's pipeline."""

    def __init__(self, r: Any, maxlen: int) -> None:
        self._script = r.register_script(_XADD_MANY)
        self.maxlen = maxlen
        self.entries: dict[str, list[bytes]] = {}
        self.values: dict[str, bytes] = {}

    def append(self, stream: str, data: bytes) -> None:
        self.entries.setdefault(stream, []).append(data)

    def set(self, key: str, data: bytes) -> None:
        self.values[key] = data

    def flush(self, client: Any) -> None:
        """Queue everything on `client` (a pipeline): one MSET, one call per stream; forget it."""
        if self.values:
            client.mset(self.values)
        for stream, entries in self.entries.items():
            if len(entries) == 1:  # a plain XADD: the usual tick
                client.xadd(stream, {"data": entries[0]}, maxlen=self.maxlen, approximate=True)
            else:
                call_script(self._script, [stream], [self.maxlen, *entries], client)
        self.drop()

    def drop(self) -> None:
        self.entries, self.values = {}, {}
