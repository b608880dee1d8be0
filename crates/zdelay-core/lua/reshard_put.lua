-- reshard_put: write jobs, as reshard_take read them from their old shard, into the shard they
-- belong to under the new shard count (mode "copy": overwrites, so writing the same job twice is
-- writing it once), or into a spread shard for zdelay upgrade (mode "transit": each id at most
-- once, ever: see ARGV[2]).
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled
-- KEYS[7] ready     ZSET  {zdelay:3}:ready
-- KEYS[8] ready_ids HASH  {zdelay:3}:ready_ids
-- KEYS[9] max_lateness HASH {zdelay:3}:max_lateness
-- KEYS[10] schedules HASH {zdelay:3}:schedules
-- KEYS[11] sched_env HASH {zdelay:3}:sched_env
-- KEYS[12] sched_due ZSET {zdelay:3}:sched_due
-- KEYS[13] sched_fired ZSET {zdelay:3}:sched_fired
-- KEYS[14] sched_quarantine HASH {zdelay:3}:sched_quarantine
-- KEYS[15] history  HASH  {zdelay:3}:history
-- KEYS[16] shards   STRING {zdelay:3}:shards    layout marker
-- KEYS[17] transit_in SET {zdelay:3}:transit_in ids an upgrade put here (mode "transit" only)
-- ARGV[1] the marker expected (the target shard's count); any other value refuses with
--   ZDELAY_NOT_MIGRATING <marker>, writing nothing
-- ARGV[2] mode: "copy" writes every record; "transit" skips a record whose id is in transit_in
--   (put by an earlier run, maybe delivered since: writing it again would deliver it twice) or
--   that the shard already holds as a job or a schedule (enqueued here meanwhile under the
--   same id: the newer one stays), and adds the ids it writes to transit_in
-- ARGV[3..] records (at most 1000): id, mask, 14 values, M, M members. mask has 14
--   characters, "1" where the value is present (in reshard_take's order: due, envelope,
--   inflight, dead, reason, scheduled, ready member, max lateness, schedule definition,
--   schedule envelope, next occurrence, schedule mark, quarantine, history); the M members
--   are added to ready (score 0).
-- Returns: { records written, records skipped as put before, records skipped as held }.
-- Re-run safety: yes ("copy": the same values overwrite themselves; "transit": a re-run skips
--   what the first wrote).
local marker = redis.call('GET', KEYS[16])
if marker ~= ARGV[1] then
  return redis.error_reply('ZDELAY_NOT_MIGRATING ' .. tostring(marker))
end
local transit = ARGV[2] == 'transit'
local function present(mask, k) return string.byte(mask, k) == 49 end -- "1"
-- Gathered per key, then one command per key for the whole batch.
local due, jobs, inflight, dead, reasons, scheduled, ready, ready_ids = {}, {}, {}, {}, {}, {}, {}, {}
local limits, schedules, sched_env, sched_due, history = {}, {}, {}, {}, {}
local sched_fired, sched_quarantine = {}, {}
local function pair(t, a, b) t[#t + 1] = a; t[#t + 1] = b end
local i, written, put_before, held = 3, 0, 0, 0
local arrived = {}
-- Which ids an earlier run put, one command for the batch.
local put = {}
if transit then
  local ids, j = {}, 3
  while j <= #ARGV do
    ids[#ids + 1] = ARGV[j]
    j = j + 17 + tonumber(ARGV[j + 16])
  end
  if #ids > 0 then
    local answers = redis.call('SMISMEMBER', KEYS[17], unpack(ids))
    for n = 1, #ids do put[ids[n]] = answers[n] == 1 end
  end
end
while i <= #ARGV do
  local id, mask, v = ARGV[i], ARGV[i + 1], i + 2
  local m = tonumber(ARGV[v + 14])
  local skip = false
  if transit then
    if put[id] then
      skip, put_before = true, put_before + 1
    elseif redis.call('HEXISTS', KEYS[2], id) == 1 or redis.call('HEXISTS', KEYS[10], id) == 1 then
      skip, held = true, held + 1
    else
      arrived[#arrived + 1] = id
    end
  end
  if not skip then
    if present(mask, 1) then pair(due, ARGV[v], id) end
    if present(mask, 2) then pair(jobs, id, ARGV[v + 1]) end
    if present(mask, 3) then pair(inflight, ARGV[v + 2], id) end
    if present(mask, 4) then pair(dead, ARGV[v + 3], id) end
    if present(mask, 5) then pair(reasons, id, ARGV[v + 4]) end
    if present(mask, 6) then pair(scheduled, id, ARGV[v + 5]) end
    if present(mask, 7) then
      pair(ready_ids, id, ARGV[v + 6])
      pair(ready, 0, ARGV[v + 6])
    end
    if present(mask, 8) then pair(limits, id, ARGV[v + 7]) end
    if present(mask, 9) then pair(schedules, id, ARGV[v + 8]) end
    if present(mask, 10) then pair(sched_env, id, ARGV[v + 9]) end
    if present(mask, 11) then pair(sched_due, ARGV[v + 10], id) end
    if present(mask, 12) then pair(sched_fired, ARGV[v + 11], id) end
    if present(mask, 13) then pair(sched_quarantine, id, ARGV[v + 12]) end
    if present(mask, 14) then pair(history, id, ARGV[v + 13]) end
    for j = 1, m do pair(ready, 0, ARGV[v + 14 + j]) end
    written = written + 1
  end
  i = v + 15 + m
end
if #arrived > 0 then redis.call('SADD', KEYS[17], unpack(arrived)) end
if #due > 0 then redis.call('ZADD', KEYS[1], unpack(due)) end
if #jobs > 0 then redis.call('HSET', KEYS[2], unpack(jobs)) end
if #inflight > 0 then redis.call('ZADD', KEYS[3], unpack(inflight)) end
if #dead > 0 then redis.call('ZADD', KEYS[4], unpack(dead)) end
if #reasons > 0 then redis.call('HSET', KEYS[5], unpack(reasons)) end
if #scheduled > 0 then redis.call('HSET', KEYS[6], unpack(scheduled)) end
if #ready > 0 then redis.call('ZADD', KEYS[7], unpack(ready)) end
if #ready_ids > 0 then redis.call('HSET', KEYS[8], unpack(ready_ids)) end
if #limits > 0 then redis.call('HSET', KEYS[9], unpack(limits)) end
if #schedules > 0 then redis.call('HSET', KEYS[10], unpack(schedules)) end
if #sched_env > 0 then redis.call('HSET', KEYS[11], unpack(sched_env)) end
if #sched_due > 0 then redis.call('ZADD', KEYS[12], unpack(sched_due)) end
if #sched_fired > 0 then redis.call('ZADD', KEYS[13], unpack(sched_fired)) end
if #sched_quarantine > 0 then redis.call('HSET', KEYS[14], unpack(sched_quarantine)) end
if #history > 0 then redis.call('HSET', KEYS[15], unpack(history)) end
return { written, put_before, held }
