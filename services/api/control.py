"""Admin commands an api sends for a client (policy swap, prefix-cache reset); mixed into ApiLoop."""

from __future__ import annotations

import asyncio
import time
import uuid

from pagedserve.shared import redis_io
from pagedserve.shared.messages import PolicyReply, PrefixCacheReset, SetPolicy


class ControlCommands:
    async def set_policy(self, name: str, options: dict, timeout_s: float = 10.0) -> PolicyReply:
        """The scheduler's reply, or TimeoutError / RedisUnavailable."""
        msg = SetPolicy(uuid.uuid4().hex, self.api_id, name, options)
        future = asyncio.get_running_loop().create_future()
        self._commands[msg.command_id] = future
        try:
            await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg), "set policy", 5.0)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._commands.pop(msg.command_id, None)

    async def reset_prefix_cache(self, timeout_s: float = 10.0, poll_s: float = 0.05) -> dict:
        """The kvstore's stats once they list this reset as done; TimeoutError or RedisUnavailable."""
        msg = PrefixCacheReset(uuid.uuid4().hex)
        await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg), "reset prefix cache", 5.0)
        deadline = time.monotonic() + timeout_s
        while True:
            stats = (await self.read_stats())["kvstore"]
            if msg.reset_id in (stats.get("prefix_cache_reset_ids") or ()):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefix cache reset {msg.reset_id} not done in {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)
