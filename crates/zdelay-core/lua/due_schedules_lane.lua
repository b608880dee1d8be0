-- due_schedules_lane: due_schedules for a route lane's schedules (storage layout 2): the lane's
-- schedules whose next occurrence is due, with their definitions, read in one consistent step
-- (read only: fire_schedules_lane decides, fenced). Its body is due_schedules' (a test keeps
-- them the same); only the fence is the lane's.
-- KEYS[1] schedules HASH   zdelay:{emj}:sched:<route>      id -> "<version>\n<definition JSON>"
-- KEYS[2] sched_due ZSET   zdelay:{emj}:sched_due:<route>  id -> its next occurrence, ms
-- KEYS[3] marker    STRING zdelay:{emj}:lane:<route>       "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] "now" in ms ("" = Redis TIME); ARGV[3] at most this many
-- Returns: { now ms, then per schedule: id, occurrence ms, "<version>\n<definition>" ("" if
--   the definition is missing) }
-- Re-run safety: yes (reads only).
local lane_marker = KEYS[3]
-- @include lane_fence
local now = ARGV[2]
if now == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(now)
end
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
local out = { now }
for i = 1, #due, 2 do
  out[#out + 1] = due[i]
  out[#out + 1] = due[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[1], due[i]) or ''
end
return out
