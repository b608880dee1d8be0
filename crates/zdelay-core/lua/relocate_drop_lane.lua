-- relocate_drop_lane: forget jobs, dead jobs and schedules of a retired route lane once the
-- relocation put them into the route's live lane (upgrade_put_lane), or, called without ids, end
-- the retired lane once it holds none: its windows, unique entries and other leftovers go (the
-- relocation copied the windows first). Only a retired lane: one that is live again (its route
-- moved back to this slot, so the live lane has these keys) refuses, writing nothing.
-- KEYS[1] due          ZSET   zdelay:{emj}:due:<route>
-- KEYS[2] jobs         HASH   zdelay:{emj}:jobs:<route>
-- KEYS[3] meta         HASH   zdelay:{emj}:meta:<route>
-- KEYS[4] maxlate      HASH   zdelay:{emj}:maxlate:<route>
-- KEYS[5] large        SET    zdelay:{emj}:large:<route>
-- KEYS[6] dead         ZSET   zdelay:{emj}:dead:<route>
-- KEYS[7] reasons      HASH   zdelay:{emj}:reasons:<route>
-- KEYS[8] history      HASH   zdelay:{emj}:history:<route>
-- KEYS[9] schedules    HASH   zdelay:{emj}:sched:<route>
-- KEYS[10] sched_env   HASH   zdelay:{emj}:sched_env:<route>
-- KEYS[11] sched_due   ZSET   zdelay:{emj}:sched_due:<route>
-- KEYS[12] sched_fired ZSET   zdelay:{emj}:sched_fired:<route>
-- KEYS[13] sched_quarantine HASH zdelay:{emj}:sched_quarantine:<route>
-- KEYS[14] windows     ZSET   zdelay:{emj}:windows:<route>  "u:<id>", "d:<id>" windows
-- KEYS[15] transit_in  SET    zdelay:{emj}:transit_in:<route>
-- KEYS[16] flow        HASH   zdelay:{emj}:flow:<route>
-- KEYS[17] marker      STRING zdelay:{emj}:lane:<route>  "retired <successor>"
-- KEYS[18] unique      HASH   zdelay:{emj}:unique:<route>
-- ARGV[1] the marker the caller read ("retired <successor>"). Another value refuses the call,
--   writing nothing: ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE.
-- ARGV[2..] stored ids (at most 1000) whose every trace goes; none: end the lane.
-- Returns: the number of ids forgotten; ending, 1 when ended, 2 when leftovers remain (at most
--   1000 entries of each key go per call: call again), 0 when it still holds a waiting or dead
--   job, a schedule or a payload (nothing is deleted then).
-- Re-run safety: yes; forgetting an id twice deletes nothing the second time.
local lane_marker = KEYS[17]
-- @include lane_fence
if string.sub(marker, 1, 8) ~= 'retired ' then
  return redis.error_reply('ZDELAY_LANE_CHANGED ' .. marker)
end
local due, jobs, meta, maxlate, large = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local dead, reasons, history = KEYS[6], KEYS[7], KEYS[8]
local schedules, sched_env, sched_due, sched_fired, sched_quarantine = KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13]
local windows, transit_in, flow, unique = KEYS[14], KEYS[15], KEYS[16], KEYS[18]
if #ARGV == 1 then
  for _, key in ipairs({ due, jobs, dead, schedules }) do
    if redis.call('EXISTS', key) == 1 then return 0 end
  end
  -- What is left: the windows (copied already) and strays, at most 1000 entries a key a call.
  local left = 0
  for _, key in ipairs({ windows, sched_due, sched_fired }) do
    redis.call('ZREMRANGEBYRANK', key, 0, 999)
    left = left + redis.call('EXISTS', key)
  end
  for _, key in ipairs({ meta, maxlate, reasons, history, sched_env, sched_quarantine, flow, unique }) do
    local fields = redis.call('HRANDFIELD', key, 1000)
    if #fields > 0 then redis.call('HDEL', key, unpack(fields)) end
    left = left + redis.call('EXISTS', key)
  end
  for _, key in ipairs({ large, transit_in }) do
    redis.call('SPOP', key, 1000)
    left = left + redis.call('EXISTS', key)
  end
  if left > 0 then return 2 end
  return 1
end
local ids, debounce = {}, {}
for i = 2, #ARGV do
  ids[#ids + 1] = ARGV[i]
  debounce[#debounce + 1] = 'd:' .. ARGV[i]
end
for _, key in ipairs({ due, dead, sched_due, sched_fired }) do redis.call('ZREM', key, unpack(ids)) end
for _, key in ipairs({ jobs, meta, maxlate, reasons, history, schedules, sched_env, sched_quarantine, unique }) do
  redis.call('HDEL', key, unpack(ids))
end
redis.call('SREM', large, unpack(ids))
redis.call('ZREM', windows, unpack(debounce))
return #ids
