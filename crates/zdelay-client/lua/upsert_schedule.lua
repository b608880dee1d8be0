-- upsert_schedule: create or update a recurring schedule, compare-and-set on its version, and
-- set its next occurrence. The caller computed the occurrence from the definition it read at
-- `expected version`; if the schedule changed since, nothing is written and it reads again.
-- KEYS[1] schedules HASH  {zdelay:3}:schedules  id -> "<version>\n<definition JSON>"
-- KEYS[2] sched_env HASH  {zdelay:3}:sched_env  id -> the envelope every occurrence carries
-- KEYS[3] sched_due ZSET  {zdelay:3}:sched_due  id -> its next occurrence, ms (absent when
--                                               paused or ended)
-- KEYS[4] shards    STRING {zdelay:3}:shards layout marker: the shard count once resharded, or
--                                           "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs
-- ARGV[2] schedule id; ARGV[3] expected version (0 = must not exist yet)
-- ARGV[4] definition JSON; ARGV[5] envelope ("" = keep the stored one); ARGV[6] next
--   occurrence ms ("" = none)
-- ARGV[7] wake channel; ARGV[8] shard number, sent in the wake message
-- Returns: { new version } or { -1, current version } when the expected version is stale.
-- Re-run safety: a re-run with the same expected version finds it stale and changes nothing.
-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[4])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local id, expected = ARGV[2], tonumber(ARGV[3])
local current = redis.call('HGET', KEYS[1], id)
local version = current and tonumber(string.match(current, '^(%d+)\n')) or 0
if version ~= expected then return { -1, version } end
version = version + 1
redis.call('HSET', KEYS[1], id, version .. '\n' .. ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[2], id, ARGV[5]) end
if ARGV[6] == '' then
  redis.call('ZREM', KEYS[3], id)
else
  local next_ms = tonumber(ARGV[6])
  local head = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  redis.call('ZADD', KEYS[3], next_ms, id)
  if not head[2] or next_ms < tonumber(head[2]) then
    redis.call('PUBLISH', ARGV[7], ARGV[8] .. ' ' .. ARGV[6])
  end
end
return { version }
