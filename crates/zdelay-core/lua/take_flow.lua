-- take_flow: admit a claim of a two-phase route's jobs from one spread shard. A two-phase
-- route with a rate or a bound waits in its own part of each spread shard's ready set; a
-- publisher asks here (one hash per route, so the limits hold across every shard and daemon)
-- and then claims at most what was granted from the part. Tokens a claim did not use come
-- back here at once. The bucket is move_lane's (include flow_bucket): the same capacity,
-- refill and wake-up. A bounded route (max_length) is admitted by one publisher at a time:
-- the grant takes the route's admission lock, held while the publisher reads its
-- destination's depth and publishes at most the room left, so no two publishers fill the
-- same room.
-- KEYS[1] flow HASH  {zdelay}:flow:<route>  "tokens" and "at" (the bucket, refilled at ms
--                                            "at"), "h<shard>" (ms the route's part in spread
--                                            shard <shard> has been held since, by its rate or
--                                            its bound; absent: flowing there), "b<shard>"
--                                            (what holds it: "rate" or "max_length"), "lock"
--                                            ("<token> <until ms>": the admission lock)
-- ARGV[1] the spread shard
-- ARGV[2] want: jobs the caller would claim now (0: take none, only give back)
-- ARGV[3] give back: tokens an earlier grant to this shard's caller that its claim did not use
-- ARGV[4] what that claim found: "caught_up" (nothing more waits in the shard's part: its
--   hold ends), "held" (the destination had no room: the part is held from now, if it was
--   not), or "" (neither)
-- ARGV[5] "now" in ms; "" = Redis TIME (tests pass an explicit value to drive time)
-- ARGV[6] the route's rate in jobs per second ("" = no rate: every want is granted);
--   ARGV[7] its burst
-- ARGV[8] the caller's lock token ("" = the route has no bound: no lock); ARGV[9] how long
--   a grant holds the lock at most, ms (a caller that dies frees it then); ARGV[10] "1" to
--   release the lock (with a give back, once the claim's jobs are published)
-- Returns: { granted (at most want: the bucket's whole tokens; 0 while another caller holds
--   the lock), now ms, when to ask again if less than want was granted (ms; "" when all
--   was), ms the shard's part has been held since ("" when flowing) }
-- A take the bucket cut holds the shard's part from then until a claim catches up: the jobs
-- claimed meanwhile count their wait as deferral, not lateness.
-- Re-run safety: no for a take (a re-run takes again; the caller gives back what it did not
-- claim, so a lost reply costs the route at most one batch of tokens, and the lock lapses);
-- yes for a give back of 0.

local flow_key = KEYS[1]
local held_field, by_field = 'h' .. ARGV[1], 'b' .. ARGV[1]
local want, give_back, found = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local now_ms
-- @include clock
now_ms = math.floor(clock_us(tonumber(ARGV[5])) / 1000)
local rate, burst = tonumber(ARGV[6]), tonumber(ARGV[7])
local token, lock_ms, release = ARGV[8], tonumber(ARGV[9]), ARGV[10] == '1'
-- @include flow_bucket
local state = redis.call('HMGET', flow_key, 'tokens', 'at', held_field, 'lock')
local held_since = state[3]
if found == 'caught_up' and held_since then
  redis.call('HDEL', flow_key, held_field, by_field)
  held_since = nil
elseif found == 'held' and not held_since then
  held_since = string.format('%d', now_ms)
  redis.call('HSET', flow_key, held_field, held_since, by_field, 'max_length')
end
local writes = {}
if token ~= '' then
  local holder, until_ms = string.match(state[4] or '', '^(%S+) (%S+)$')
  until_ms = tonumber(until_ms)
  local mine = holder == token
  if holder and not mine and until_ms > now_ms then
    -- Another publisher admits now: ask again once it is done (it releases), or the lock lapses.
    return { 0, now_ms, string.format('%d', until_ms), held_since or '' }
  end
  if release and mine then redis.call('HDEL', flow_key, 'lock') end
end
local granted, wake = want, ''
if rate then
  local capacity = bucket_capacity(rate, burst)
  local tokens, at, whole = bucket_refill(rate, capacity, tonumber(state[1]), tonumber(state[2]), now_ms)
  if give_back > 0 then
    tokens = math.min(capacity, tokens + give_back)
    whole = math.max(0, math.floor(tokens + 1e-9))
  end
  granted = math.min(want, whole)
  tokens = tokens - granted
  if granted < want then
    wake = string.format('%d', bucket_wake(rate, capacity, tokens, at, want))
    if not held_since then
      held_since = string.format('%d', now_ms)
      writes[#writes + 1] = held_field
      writes[#writes + 1] = held_since
      writes[#writes + 1] = by_field
      writes[#writes + 1] = 'rate'
    end
  end
  -- %.17g: read back exactly (tostring keeps 14 digits).
  writes[#writes + 1] = 'tokens'
  writes[#writes + 1] = string.format('%.17g', tokens)
  writes[#writes + 1] = 'at'
  writes[#writes + 1] = at
end
if token ~= '' and not release and granted > 0 then
  writes[#writes + 1] = 'lock'
  writes[#writes + 1] = token .. ' ' .. string.format('%d', now_ms + lock_ms)
end
if #writes > 0 then redis.call('HSET', flow_key, unpack(writes)) end
return { granted, now_ms, wake, held_since or '' }
