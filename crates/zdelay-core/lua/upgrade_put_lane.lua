-- upgrade_put_lane: write jobs, dead jobs and schedules of one local route into the route's lane
-- (storage layout 2): for zdelay upgrade, as reshard_take read them from a layout-1 shard, and for
-- a lane relocation, as read from the route's retired lane in another slot. Each id is written at
-- most once, ever: an id in transit_in was put by an earlier run (and may have been delivered
-- since), an id the lane already holds was enqueued here meanwhile (the newer job stays); both are
-- skipped.
-- KEYS[1] due          ZSET   zdelay:{emj}:due:<route>
-- KEYS[2] jobs         HASH   zdelay:{emj}:jobs:<route>     stored id -> payload
-- KEYS[3] meta         HASH   zdelay:{emj}:meta:<route>     stored id -> meta JSON
-- KEYS[4] maxlate      HASH   zdelay:{emj}:maxlate:<route>  stored id -> max lateness ms
-- KEYS[5] large        SET    zdelay:{emj}:large:<route>    stored ids whose payload is over 4096 bytes
-- KEYS[6] dead         ZSET   zdelay:{emj}:dead:<route>
-- KEYS[7] reasons      HASH   zdelay:{emj}:reasons:<route>
-- KEYS[8] history      HASH   zdelay:{emj}:history:<route>
-- KEYS[9] schedules    HASH   zdelay:{emj}:sched:<route>
-- KEYS[10] sched_env   HASH   zdelay:{emj}:sched_env:<route>
-- KEYS[11] sched_due   ZSET   zdelay:{emj}:sched_due:<route>
-- KEYS[12] sched_fired ZSET   zdelay:{emj}:sched_fired:<route>
-- KEYS[13] sched_quarantine HASH zdelay:{emj}:sched_quarantine:<route>
-- KEYS[14] transit_in  SET    zdelay:{emj}:transit_in:<route> ids an upgrade or relocation put here
-- KEYS[15] relocating  STRING zdelay:{emj}:relocating:<route> the relocation's lock: its holder's token
-- KEYS[16] marker      STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- KEYS[17] unique      HASH   zdelay:{emj}:unique:<route>   stored id -> its unique_for window ms
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] a relocation's lock token ("" for the upgrade, which needs none): another value in
--   KEYS[15] refuses the call with ZDELAY_RELOCATING (another run took over), writing nothing;
--   the lock is extended to 10 s otherwise, so a run that stalls past it cannot write later.
-- ARGV[3..] records (at most 1000): id, mask, 13 values. mask has 13 characters, "1" where the
--   value is present, in this order: due score, payload, meta JSON, max lateness ms, dead score,
--   reason, history, schedule definition, schedule envelope (zd1 frame), next occurrence,
--   schedule mark, quarantine, unique_for window ms. Scores as Redis printed them.
-- Returns: { records written, records skipped as put before, records skipped as held }.
-- Re-run safety: yes; a re-run skips what the first wrote.
local lane_marker = KEYS[16]
-- @include lane_fence
if ARGV[2] ~= '' then
  if redis.call('GET', KEYS[15]) ~= ARGV[2] then
    return redis.error_reply('ZDELAY_RELOCATING another run holds the relocation')
  end
  redis.call('PEXPIRE', KEYS[15], 10000)
end
local SMALL = 4096
local VALUES = 13
local function present(mask, k) return string.byte(mask, k) == 49 end -- "1"
-- Where each value goes: a ZSET takes (score, id), a HASH (id, value); gathered per key, then
-- one command per key for the whole batch.
local targets = {
  { KEYS[1], 'zset' }, { KEYS[2], 'hash' }, { KEYS[3], 'hash' }, { KEYS[4], 'hash' },
  { KEYS[6], 'zset' }, { KEYS[7], 'hash' }, { KEYS[8], 'hash' }, { KEYS[9], 'hash' },
  { KEYS[10], 'hash' }, { KEYS[11], 'zset' }, { KEYS[12], 'zset' }, { KEYS[13], 'hash' },
  { KEYS[17], 'hash' },
}
local gathered = {}
for k = 1, VALUES do gathered[k] = {} end
local large, arrived = {}, {}
local written, put_before, held = 0, 0, 0
local ids = {}
for i = 3, #ARGV, VALUES + 2 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return { 0, 0, 0 } end
-- What the lane holds of these ids, one command per key for the whole batch (a call per id
-- costs more than its command): put before, waiting, dead, or a schedule.
local put = redis.call('SMISMEMBER', KEYS[14], unpack(ids))
local waiting = redis.call('ZMSCORE', KEYS[1], unpack(ids))
local died = redis.call('ZMSCORE', KEYS[6], unpack(ids))
local scheduled = redis.call('HMGET', KEYS[9], unpack(ids))
for n = 1, #ids do
  local i = 3 + (n - 1) * (VALUES + 2)
  local id, mask = ARGV[i], ARGV[i + 1]
  if put[n] == 1 then
    put_before = put_before + 1
  elseif waiting[n] or died[n] or scheduled[n] then
    held = held + 1
  else
    for k = 1, VALUES do
      if present(mask, k) then
        local t, value = gathered[k], ARGV[i + 1 + k]
        if targets[k][2] == 'zset' then
          t[#t + 1] = value; t[#t + 1] = id
        else
          t[#t + 1] = id; t[#t + 1] = value
        end
      end
    end
    if present(mask, 2) and #ARGV[i + 3] > SMALL then large[#large + 1] = id end
    arrived[#arrived + 1] = id
    written = written + 1
  end
end
for k = 1, VALUES do
  local t = gathered[k]
  if #t > 0 then
    if targets[k][2] == 'zset' then
      redis.call('ZADD', targets[k][1], unpack(t))
    else
      redis.call('HSET', targets[k][1], unpack(t))
    end
  end
end
if #large > 0 then redis.call('SADD', KEYS[5], unpack(large)) end
if #arrived > 0 then redis.call('SADD', KEYS[14], unpack(arrived)) end
return { written, put_before, held }
