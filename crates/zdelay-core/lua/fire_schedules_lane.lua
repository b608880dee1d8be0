-- fire_schedules_lane: fire_schedules for the schedules kept in a route lane (storage layout
-- 2): turn due occurrences into the lane's jobs, raise each schedule's high-water mark and write
-- its pending occurrence, in one step, as fire_schedules does (same arguments, same replies,
-- same invariants: an occurrence at or before the mark is never written, the mark only rises).
-- An occurrence is written as the lane keeps a job: the payload of the schedule's zd1 frame in
-- jobs, its meta apart, its max lateness in maxlate, a payload over 4096 bytes listed in large.
-- So the occurrence is in the slot of the list it is moved to: exactly once on a cluster too.
-- An occurrence that is due now goes straight onto that list instead, in this step (when the
-- lane's due jobs are all later, the occurrence within its max lateness and the largest
-- payload: fire_schedules_body), so the firing of a crowded second costs no job write and no
-- move.
-- KEYS[1] due          ZSET   zdelay:{emj}:due:<route>
-- KEYS[2] jobs         HASH   zdelay:{emj}:jobs:<route>     stored id -> payload
-- KEYS[3] meta         HASH   zdelay:{emj}:meta:<route>     stored id -> meta JSON
-- KEYS[4] large        SET    zdelay:{emj}:large:<route>    stored ids whose payload is over 4096 bytes
-- KEYS[5] dead         ZSET   zdelay:{emj}:dead:<route>
-- KEYS[6] reasons      HASH   zdelay:{emj}:reasons:<route>
-- KEYS[7] maxlate      HASH   zdelay:{emj}:maxlate:<route>  stored id -> max lateness ms
-- KEYS[8] schedules    HASH   zdelay:{emj}:sched:<route>    id -> "<version>\n<definition JSON>"
-- KEYS[9] sched_env    HASH   zdelay:{emj}:sched_env:<route> id -> the occurrences' zd1 frame
-- KEYS[10] sched_due   ZSET   zdelay:{emj}:sched_due:<route> id -> pending occurrence ms
-- KEYS[11] sched_fired ZSET   zdelay:{emj}:sched_fired:<route> id -> high-water mark ms
-- KEYS[12] sched_quarantine HASH zdelay:{emj}:sched_quarantine:<route> id -> "<ms> <reason>"
-- KEYS[13] marker      STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- KEYS[14] sched_health HASH zdelay:{emj}:sched_health:<route> id -> health record
-- KEYS[15] list        LIST   the route's list (as move_lane's KEYS[9])
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] now ms (when occurrences expired die, when a quarantine began)
-- ARGV[3] mark retention ms: marks older than now minus this are pruned, at most 100 a call
-- ARGV[4] "LPUSH" | "RPUSH": push due occurrences straight onto the list; "" = never (a
--   stream, or a route with flow control: its move decides)
-- ARGV[5] the push's now, ms ("" = Redis TIME; a test clock's time otherwise)
-- ARGV[6] largest payload in bytes (a larger one waits in due, and its move sends it to dead)
-- ARGV[7] B, the number of lateness bucket bounds; then B bounds in ms, ascending
-- ARGV[8 + B..] per schedule: id, its pending occurrence as due_schedules read it (the exact
--   score text), version read ("" when the definition has none), the mark to set ("" =
--   leave it), next pending occurrence ms ("" = none: ended), max lateness ms ("" = none),
--   quarantine reason ("" = none; otherwise nothing else applies), occurrences missed (passed
--   over by the misfire policy), occurrences skipped by calendar, D, then D triples (job id,
--   occurrence ms, due ms: the occurrence, or later by the schedule's jitter) to deliver, E, then E pairs (job id, occurrence ms) expired
-- Returns: { jobs created (written due), occurrences expired, schedules fenced, occurrences
--   missed, occurrences skipped by calendar, occurrences pushed onto the list, the push's now
--   ms (0 without a push), their largest lateness ms, B + 1 (0 when none was pushed), then the pushed occurrences per lateness bucket (B + 1 integers; the
--   last is over the largest bound), then for each schedule quarantined its id and the
--   reason };
--   error ZDELAY_FIRE_BOUND <n> (nothing written) when the call carries more than 1000
--   occurrences.
-- Re-run safety: yes; the first run moved each schedule's pending occurrence, so a re-run is
--   fenced, and no occurrence at or before the mark is written.
local lane_marker = KEYS[13]
-- @include lane_fence
local due_key, jobs_key, meta_key, large_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local dead_key, reasons_key, limit_key = KEYS[5], KEYS[6], KEYS[7]
local schedules_key, env_key, sched_due_key = KEYS[8], KEYS[9], KEYS[10]
local fired_key, quarantine_key, health_key = KEYS[11], KEYS[12], KEYS[14]
local list_key = KEYS[15]
local SMALL = 4096
-- @include clock
local bound_count = tonumber(ARGV[7])
local FIRST, direct = 8 + bound_count, nil
if ARGV[4] ~= '' then
  local bounds = {}
  for b = 1, bound_count do bounds[b] = tonumber(ARGV[7 + b]) end
  direct = { push = ARGV[4], list = list_key, now = math.floor(clock_us(tonumber(ARGV[5])) / 1000),
    max_payload = tonumber(ARGV[6]), bounds = bounds }
end
-- An occurrence is written as the lane keeps a job: the payload of the schedule's zd1 frame,
-- its meta apart (cut as move_due reads a frame), a payload over SMALL listed in large.
local function split(frame)
  if string.sub(frame, 1, 4) ~= 'zd1:' then
    return nil, 'the envelope stored for its occurrences is not a zd1 frame'
  end
  local a = string.find(frame, '\n', 5, true)
  local b = a and string.find(frame, '\n', a + 1, true)
  local digits = b and string.sub(frame, a + 1, b - 1)
  local meta_len = digits and string.find(digits, '^%d+$') and tonumber(digits)
  if not meta_len or b + meta_len > #frame then
    return nil, 'the envelope stored for its occurrences is not a zd1 frame'
  end
  return string.sub(frame, b + meta_len + 1), string.sub(frame, b + 1, b + meta_len)
end
local function write_job(job, payload, meta)
  if redis.call('HSETNX', jobs_key, job, payload) == 0 then return false end
  if meta ~= '' then redis.call('HSET', meta_key, job, meta) end
  return true
end
local function waiting(job, payload)
  if #payload > SMALL then redis.call('SADD', large_key, job) end
end
-- @include fire_schedules_body
