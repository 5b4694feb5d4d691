"""Admin commands an api sends for a client (policy swap, prefix-cache reset); mixed into ApiLoop.
Each goes out on the requests stream (in order with submissions) and is answered by one
CommandReply on this api's deltas stream: the scheduler answers SetPolicy, the kvstore the reset."""

from __future__ import annotations

import asyncio
import uuid

from pagedserve.shared import redis_io
from pagedserve.shared.messages import CommandReply, PrefixCacheReset, SetPolicy


class ControlCommands:
    async def set_policy(self, name: str, options: dict, timeout_s: float = 10.0) -> CommandReply:
        """The scheduler's reply (result: the policy in force), or TimeoutError / RedisUnavailable."""
        return await self._command(SetPolicy(uuid.uuid4().hex, self.api_id, name, options), "set policy", timeout_s)

    async def reset_prefix_cache(self, timeout_s: float = 10.0) -> CommandReply:
        """The kvstore's reply once every pool and the tier forgot their cached prefixes (its stats
        already show it), or TimeoutError / RedisUnavailable."""
        return await self._command(PrefixCacheReset(uuid.uuid4().hex, self.api_id), "reset prefix cache", timeout_s)

    async def _command(self, msg: SetPolicy | PrefixCacheReset, what: str, timeout_s: float) -> CommandReply:
        future = asyncio.get_running_loop().create_future()
        self._commands[msg.command_id] = future
        try:
            await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg), what, 5.0)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._commands.pop(msg.command_id, None)
