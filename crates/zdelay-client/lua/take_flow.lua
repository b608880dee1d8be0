-- take_flow: take tokens from a two-phase route's rate bucket for one spread shard's claim.
-- A two-phase route's jobs wait in its own part of each spread shard's ready set; a publisher
-- takes tokens here (one bucket per route, so the rate holds across every shard and daemon)
-- and then claims at most that many from the part. Tokens a claim did not use come back
-- here at once. The bucket is move_lane's (include flow_bucket): the same capacity, refill
-- and wake-up.
-- KEYS[1] flow HASH  {zdelay}:flow:<route>  "tokens" and "at" (the bucket, refilled at ms
--                                            "at"), "h<shard>" (ms the route's part in spread
--                                            shard <shard> has been held since by the rate;
--                                            absent: flowing there)
-- ARGV[1] the spread shard
-- ARGV[2] want: jobs the caller would claim now (0: take none, only give back)
-- ARGV[3] give back: tokens an earlier take of this shard granted that its claim did not use
-- ARGV[4] "1" when that claim found nothing more waiting in the shard's part: the shard has
--   caught up, and its hold (if any) ends
-- ARGV[5] "now" in ms; "" = Redis TIME (tests pass an explicit value to drive time)
-- ARGV[6] the route's rate in jobs per second; ARGV[7] its burst
-- Returns: { granted (at most want: the bucket's whole tokens), now ms, when the part may
--   claim again if the bucket cut the take (ms; "" when it did not), ms the shard's part has
--   been held since ("" when flowing) }
-- A take the bucket cut holds the shard's part from then until a claim catches up: the jobs
-- claimed meanwhile count their wait as deferral, not lateness.
-- Re-run safety: no for a take (a re-run takes again; the caller gives back what it did not
-- claim, so a lost reply costs the route at most one batch of tokens); yes for give back 0.

local flow_key = KEYS[1]
local held_field = 'h' .. ARGV[1]
local want, give_back = tonumber(ARGV[2]), tonumber(ARGV[3])
local now_ms
if ARGV[5] ~= '' then
  now_ms = tonumber(ARGV[5])
else
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local rate, burst = tonumber(ARGV[6]), tonumber(ARGV[7])
-- @include flow_bucket
local capacity = bucket_capacity(rate, burst)
local state = redis.call('HMGET', flow_key, 'tokens', 'at', held_field)
local tokens, at, whole = bucket_refill(rate, capacity, tonumber(state[1]), tonumber(state[2]), now_ms)
local held_since = state[3]
if give_back > 0 then
  tokens = math.min(capacity, tokens + give_back)
  whole = math.max(0, math.floor(tokens + 1e-9))
end
if ARGV[4] == '1' and held_since then
  redis.call('HDEL', flow_key, held_field)
  held_since = nil
end
local granted = math.min(want, whole)
tokens = tokens - granted
local wake = ''
if granted < want then
  wake = string.format('%d', bucket_wake(rate, capacity, tokens, at, want))
  if not held_since then
    held_since = string.format('%d', now_ms)
    redis.call('HSET', flow_key, held_field, held_since)
  end
end
-- %.17g: read back exactly (tostring keeps 14 digits).
redis.call('HSET', flow_key, 'tokens', string.format('%.17g', tokens), 'at', at)
return { granted, now_ms, wake, held_since or '' }
