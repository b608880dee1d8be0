-- take_keys: admit the jobs a publisher claimed for a two-phase route with a per-key rate
-- (key_rate), each by its key's bucket, in claim order. The buckets are move_lane's (include
-- key_bucket), in the route's flow hash, shared by every spread shard and daemon. A job whose
-- key has no whole token gets its turn instead: its token is taken now, the turn is recorded,
-- and the publisher puts the job back due at its turn, where the next claim of it goes
-- without asking again (it took its token with the turn). So a key's jobs, at once and at
-- their turns together, stay within key_burst + key_rate * T in any span T, and a key's new
-- jobs queue behind its waiting ones while other keys' jobs flow.
-- KEYS[1] flow  HASH {zdelay}:flow:<route>   per key "k:<key>" -> "<tokens> <refilled at ms>
--                                            <when it next has a whole token, ms>" (and the
--                                            route's bucket, which take_flow keeps)
-- KEYS[2] turns ZSET {zdelay}:turns:<route>  "<shard> <id>" -> the turn a job was given, ms
--                                            (removed when the job is claimed; a turn an
--                                            hour past is forgotten and dropped, 100 per
--                                            call: jobs cancelled or replaced meanwhile)
-- ARGV[1] the spread shard; ARGV[2] "now" in ms ("" = Redis TIME); ARGV[3] the rate per key
--   in jobs per second; ARGV[4] the burst per key
-- ARGV[5..] pairs: job id, its key (the value of the route's key_header, "" without one)
-- Returns: { now ms, then per job: 0 (it goes now), or its turn in ms (put it back due then),
--   or -turn (it goes now, at the turn it was given earlier: its wait since its due was
--   deferral) }
-- Re-run safety: no (a re-run takes tokens again); the caller settles every job it asked
-- about, so a lost reply costs those keys a token each.

local flow_key, turns_key = KEYS[1], KEYS[2]
local now_ms
-- @include clock
now_ms = math.floor(clock_us(tonumber(ARGV[2])) / 1000)
local key_rate, key_burst = tonumber(ARGV[3]), tonumber(ARGV[4])
-- @include key_bucket
local shard = ARGV[1]
local n = (#ARGV - 4) / 2
local reply = { now_ms }
if n < 1 then return reply end
-- Jobs claimed at the turn they were given go without a token; a turn an hour past is
-- forgotten (the job asks again).
local forget_before = now_ms - 3600000
local members = {}
for i = 1, n do members[i] = shard .. ' ' .. ARGV[3 + 2 * i] end
local given = redis.call('ZMSCORE', turns_key, unpack(members))
local order, seen, granted = {}, {}, {}
for i = 1, n do
  if given[i] then
    granted[#granted + 1] = members[i]
    if tonumber(given[i]) <= forget_before then given[i] = false end
  end
  if not given[i] then
    local key = ARGV[4 + 2 * i]
    if not seen[key] then
      seen[key] = true
      order[#order + 1] = key
    end
  end
end
local buckets = key_buckets(flow_key, order)
local turns = {}
for i = 1, n do
  if given[i] then
    reply[i + 1] = -math.floor(tonumber(given[i]))
  else
    local turn = key_take(buckets[ARGV[4 + 2 * i]])
    if turn then
      turns[#turns + 1] = turn
      turns[#turns + 1] = members[i]
      reply[i + 1] = turn
    else
      reply[i + 1] = 0
    end
  end
end
key_buckets_write(flow_key, buckets, order)
if #granted > 0 then redis.call('ZREM', turns_key, unpack(granted)) end
if #turns > 0 then redis.call('ZADD', turns_key, unpack(turns)) end
-- A few forgotten turns at a time (jobs cancelled or replaced while they waited).
local stale = redis.call('ZRANGEBYSCORE', turns_key, '-inf', forget_before, 'LIMIT', 0, 100)
if #stale > 0 then redis.call('ZREM', turns_key, unpack(stale)) end
return reply
