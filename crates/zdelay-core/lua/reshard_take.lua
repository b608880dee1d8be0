-- reshard_take: everything one shard stores about some job (or schedule) ids, for zdelay reshard to copy
-- them into the shard they belong to under the new shard count. Reads only.
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled
-- KEYS[7] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[8] max_lateness HASH {zdelay:3}:max_lateness
-- KEYS[9] schedules HASH  {zdelay:3}:schedules   schedule id -> "<version>\n<definition>"
-- KEYS[10] sched_env HASH {zdelay:3}:sched_env   schedule id -> its occurrences' envelope
-- KEYS[11] sched_due ZSET {zdelay:3}:sched_due   schedule id -> next occurrence
-- KEYS[12] sched_fired ZSET {zdelay:3}:sched_fired schedule id -> its high-water mark
-- KEYS[13] sched_quarantine HASH {zdelay:3}:sched_quarantine schedule id -> why quarantined
-- KEYS[14] history  HASH  {zdelay:3}:history     id -> its earlier deaths (dead replay)
-- KEYS[15] shards   STRING {zdelay:3}:shards    layout marker
-- ARGV[1] the marker the running move set (an upgrade's "upgrading 2 <version>", a reshard's
--   new count): any other value refuses with ZDELAY_NOT_MIGRATING <marker> (another run
--   finished, or none runs)
-- ARGV[2] byte budget: the ids taken are the longest prefix whose envelopes, schedule
--   envelopes and histories add up to at most this many bytes (at least one id), so one call
--   never copies more than about this into its reply, whatever the payloads weigh
-- ARGV[3..] ids, at most 1000
-- Returns: per id taken (a prefix of the ids, at least one), 14 values (nil where absent): due
--   score, envelope, inflight score (lease deadline), dead score, reason, scheduled due, its
--   member in ready, max lateness, schedule definition, schedule envelope, next occurrence,
--   schedule mark, quarantine, history. Scores as Redis prints them, so they are written back
--   exactly.
-- Re-run safety: yes (read only).
local marker = redis.call('GET', KEYS[15])
if marker ~= ARGV[1] then
  return redis.error_reply('ZDELAY_NOT_MIGRATING ' .. tostring(marker))
end
local budget = tonumber(ARGV[2])
local ids = {}
local bytes = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  -- HSTRLEN is O(1): the envelopes' sizes are known before any is copied. (One call per id
  -- costs more than its command; schedule envelopes and histories, which few ids have, are
  -- read for the whole batch below and the prefix cut again.)
  bytes = bytes + redis.call('HSTRLEN', KEYS[2], id)
  if #ids > 0 and bytes > budget then break end
  ids[#ids + 1] = id
end
if #ids == 0 then return {} end
local sched_env = redis.call('HMGET', KEYS[10], unpack(ids))
local history = redis.call('HMGET', KEYS[14], unpack(ids))
bytes = 0
local n = 0
local envelopes = redis.call('HMGET', KEYS[2], unpack(ids))
for i = 1, #ids do
  bytes = bytes + (envelopes[i] and #envelopes[i] or 0) + (sched_env[i] and #sched_env[i] or 0)
    + (history[i] and #history[i] or 0)
  if n > 0 and bytes > budget then break end
  n = n + 1
end
for i = #ids, n + 1, -1 do ids[i] = nil end
-- One command per key for the whole batch (ZMSCORE, HMGET), not one per id.
local cols = {
  redis.call('ZMSCORE', KEYS[1], unpack(ids)),
  envelopes,
  redis.call('ZMSCORE', KEYS[3], unpack(ids)),
  redis.call('ZMSCORE', KEYS[4], unpack(ids)),
  redis.call('HMGET', KEYS[5], unpack(ids)),
  redis.call('HMGET', KEYS[6], unpack(ids)),
  redis.call('HMGET', KEYS[7], unpack(ids)),
  redis.call('HMGET', KEYS[8], unpack(ids)),
  redis.call('HMGET', KEYS[9], unpack(ids)),
  sched_env,
  redis.call('ZMSCORE', KEYS[11], unpack(ids)),
  redis.call('ZMSCORE', KEYS[12], unpack(ids)),
  redis.call('HMGET', KEYS[13], unpack(ids)),
  history,
}
local out = {}
for i = 1, #ids do
  for c = 1, #cols do out[#out + 1] = cols[c][i] end
end
return out
