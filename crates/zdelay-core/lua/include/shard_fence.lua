-- Included first by every script on a spread shard's keys (`-- @include shard_fence`), after
-- `local shard_marker = KEYS[<n>]` names the shard's `:shards` marker, with ARGV[1] the shard
-- count the caller computed the shard with. Refuses, writing nothing, a shard the caller reached
-- with another count (ZDELAY_RESHARDED <shards>: read the schema again) and one a newer storage
-- layout owns (ZDELAY_LAYOUT <layout> <min version>, from a marker "layout <layout> <min
-- version>", or "upgrading …" while it moves in). No marker: the shard was never resharded.

local shard_marker_now = redis.call('GET', shard_marker)
if shard_marker_now and shard_marker_now ~= ARGV[1] then
  local newer = string.match(shard_marker_now, '^layout (.+)')
    or string.match(shard_marker_now, '^upgrading (.+)')
  if newer then return redis.error_reply('ZDELAY_LAYOUT ' .. newer) end
  return redis.error_reply('ZDELAY_RESHARDED ' .. shard_marker_now)
end
