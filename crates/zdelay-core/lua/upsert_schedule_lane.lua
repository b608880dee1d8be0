-- upsert_schedule_lane: upsert_schedule for a schedule kept in its destination's route lane
-- (storage layout 2): create or update it, compare-and-set on its version and high-water mark,
-- and set its pending occurrence. Its body is upsert_schedule's (a test keeps them the same);
-- only the fence is the lane's, and the wake name is the lane's ("l<lane>").
-- KEYS[1] schedules HASH   zdelay:{emj}:sched:<route>      id -> "<version>\n<definition JSON>"
-- KEYS[2] sched_env HASH   zdelay:{emj}:sched_env:<route>  id -> the zd1 frame every occurrence carries
-- KEYS[3] sched_due ZSET   zdelay:{emj}:sched_due:<route>  id -> its pending occurrence, ms
-- KEYS[4] sched_fired ZSET zdelay:{emj}:sched_fired:<route> id -> its high-water mark, ms
-- KEYS[5] sched_quarantine HASH zdelay:{emj}:sched_quarantine:<route> id -> "<ms> <reason>" (cleared)
-- KEYS[6] marker    STRING zdelay:{emj}:lane:<route>       "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] schedule id; ARGV[3] expected version (0 = none: no schedule, or a definition
--   without a readable version); ARGV[4] the mark read ("" = none)
-- ARGV[5] definition JSON; ARGV[6] envelope ("" = keep the stored one)
-- ARGV[7] the pending occurrence: "keep" (the timing did not change: left as it is), "same"
--   (like keep, and only the update time changed: if the stored envelope is ARGV[6] too,
--   nothing is written and the version stays, so a firing fenced on it goes on), "pause"
--   (none while paused), "none" (the definition has no next occurrence) or the next
--   occurrence ms, which must be after the mark. With "none" or a time, a pending occurrence
--   already due (at or before Redis TIME) stays: the mover plans it with the new definition,
--   whose misfire policy decides what is delivered.
-- ARGV[8] now ms, as the caller read it: a new schedule's mark (nothing at or before its
--   creation fires)
-- ARGV[9] wake channel; ARGV[10] the lane's wake name ("l<lane>"), sent in the wake message
-- Returns: { version (the new one; the same when "same" wrote nothing), pending occurrence ms
--   ("" = none) } or { -1, current version } when
--   the version or the mark is not what was read (read again).
-- Re-run safety: a re-run with the same expected version finds it stale and changes nothing.
local lane_marker = KEYS[6]
-- @include lane_fence
local id, expected, read_mark, mode = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[7]
local current = redis.call('HGET', KEYS[1], id)
local version = current and tonumber(string.match(current, '^(%d+)\n')) or 0
if version ~= expected then return { -1, version } end
local mark = tonumber(redis.call('ZSCORE', KEYS[4], id))
if mark ~= tonumber(read_mark) then return { -1, version } end
local pending = redis.call('ZSCORE', KEYS[3], id)
-- Quarantined since it was read: there is no pending occurrence to keep.
if (mode == 'keep' or mode == 'same') and not pending and redis.call('HEXISTS', KEYS[5], id) == 1 then
  return { -1, version }
end
if mode == 'same' then
  local env = ARGV[6]
  if env == '' or (redis.call('HSTRLEN', KEYS[2], id) == #env and redis.call('HGET', KEYS[2], id) == env) then
    return { version, pending or '' }
  end
  mode = 'keep'
end
local next_ms = tonumber(mode)
-- INVARIANT: a pending occurrence is after the mark, so no occurrence is written twice.
if next_ms and mark and next_ms <= mark then return { -1, version } end
version = version + 1
redis.call('HSET', KEYS[1], id, version .. '\n' .. ARGV[5])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[2], id, ARGV[6]) end
redis.call('HDEL', KEYS[5], id)
if not current then redis.call('ZADD', KEYS[4], 'GT', ARGV[8], id) end
if mode == 'pause' then
  redis.call('ZREM', KEYS[3], id)
  pending = nil
elseif mode ~= 'keep' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = tonumber(pending)
  if due and due <= now and due > -math.huge and due == math.floor(due) then
    -- Due already (no daemon fired it yet): left for the mover's plan.
  elseif next_ms then
    local head = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    redis.call('ZADD', KEYS[3], next_ms, id)
    pending = mode
    if not head[2] or next_ms < tonumber(head[2]) then
      redis.call('PUBLISH', ARGV[9], ARGV[10] .. ' ' .. mode)
    end
  else
    redis.call('ZREM', KEYS[3], id)
    pending = nil
  end
end
return { version, pending or '' }
