-- upsert_schedule: create or update a recurring schedule, compare-and-set on its version, and
-- set its next occurrence. The caller computed the occurrence from the definition it read at
-- `expected version`; if the schedule changed since, nothing is written and it reads again.
-- KEYS[1] schedules HASH  {zdelay:3}:schedules  id -> "<version>\n<definition JSON>"
-- KEYS[2] sched_env HASH  {zdelay:3}:sched_env  id -> the envelope every occurrence carries
-- KEYS[3] sched_due ZSET  {zdelay:3}:sched_due  id -> its next occurrence, ms (absent when
--                                               paused or ended)
-- ARGV[1] schedule id; ARGV[2] expected version (0 = must not exist yet)
-- ARGV[3] definition JSON; ARGV[4] envelope ("" = keep the stored one); ARGV[5] next
--   occurrence ms ("" = none)
-- ARGV[6] wake channel; ARGV[7] shard number, sent in the wake message
-- Returns: { new version } or { -1, current version } when the expected version is stale.
-- Re-run safety: a re-run with the same expected version finds it stale and changes nothing.
local id, expected = ARGV[1], tonumber(ARGV[2])
local current = redis.call('HGET', KEYS[1], id)
local version = current and tonumber(string.match(current, '^(%d+)\n')) or 0
if version ~= expected then return { -1, version } end
version = version + 1
redis.call('HSET', KEYS[1], id, version .. '\n' .. ARGV[3])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], id, ARGV[4]) end
if ARGV[5] == '' then
  redis.call('ZREM', KEYS[3], id)
else
  local next_ms = tonumber(ARGV[5])
  local head = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  redis.call('ZADD', KEYS[3], next_ms, id)
  if not head[2] or next_ms < tonumber(head[2]) then
    redis.call('PUBLISH', ARGV[6], ARGV[7] .. ' ' .. ARGV[5])
  end
end
return { version }
