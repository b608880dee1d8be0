-- ready_sinks: the sinks that jobs wait for in a shard's ready set, as found in Redis (whether
-- configured or not), with how many wait for each and the oldest one's due. O(S log N) for S
-- sinks: one ZRANGEBYLEX jump to the next sink's first member, and one ZLEXCOUNT, per sink.
-- KEYS[1] ready     ZSET  {zdelay:3}:ready      member = "<sink>\n<due, 16 digits>\n<id>", score 0
-- KEYS[2] shards    STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] the most sinks to report (a bound against a damaged set of many distinct prefixes)
-- Returns: { S, then S triples: sink name, jobs waiting for it, the oldest one's due ms ("" when
--   unreadable) }, in name order.
-- Re-run safety: yes; it only reads.

local shard_marker = KEYS[2]
-- @include shard_fence
local limit = tonumber(ARGV[2])
local out = { 0 }
local from = '-'
while out[1] < limit do
  local first = redis.call('ZRANGEBYLEX', KEYS[1], from, '+', 'LIMIT', 0, 1)[1]
  if not first then break end
  local cut = string.find(first, '\n', 1, true)
  local sink, due, past = first, '', '(' .. first
  if cut then
    -- "\n" is byte 10: "<sink>\11" sorts after every member of the sink.
    sink = string.sub(first, 1, cut - 1)
    due = string.match(first, '^%d+', cut + 1) or ''
    past = '[' .. sink .. '\11'
  end
  local count = cut and redis.call('ZLEXCOUNT', KEYS[1], '[' .. sink .. '\n', '(' .. sink .. '\11') or 1
  out[1] = out[1] + 1
  out[#out + 1] = sink
  out[#out + 1] = count
  out[#out + 1] = due
  from = past
end
return out
