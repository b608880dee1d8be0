-- Included by move_lane and take_keys (`-- @include key_bucket`): the per-key buckets of a
-- route's key_rate. Needs the locals now_ms, key_rate and key_burst.

-- A key's state, field "k:<key>" of the route's flow hash: "<tokens> <refilled at ms> <when it
-- next has a whole token, ms>". The last field keeps a waiting key's place for a daemon that
-- reads it alone (and is read for the same reason: tokens never exceed what it allows).
local key_step = 1000 / key_rate
-- The buckets of `order` (distinct keys), refilled to now: key -> { tokens, at }.
local function key_buckets(flow_key, order)
  local buckets = {}
  if #order == 0 then return buckets end
  local fields = {}
  for k = 1, #order do fields[k] = 'k:' .. order[k] end
  local states = redis.call('HMGET', flow_key, unpack(fields))
  for k = 1, #order do
    local t, at, free = key_burst, now_ms, now_ms
    if states[k] then
      local ts, as, fs = string.match(states[k], '^(%S+) (%S+) (%S+)$')
      t, at, free = tonumber(ts) or key_burst, tonumber(as) or now_ms, tonumber(fs) or now_ms
    end
    if now_ms > at then
      t = math.min(key_burst, t + (now_ms - at) * key_rate / 1000)
      at = now_ms
    end
    if free > at then t = math.min(t, 1 - (free - at) / key_step) end
    buckets[order[k]] = { tokens = t, at = at }
  end
  return buckets
end
-- Takes a token of bucket b for one job: nil when it had a whole one (the job goes now), else
-- the job's turn (ms), whose token is taken now (the bucket goes below zero; the next turn is
-- when it has paid that back and has a whole token again). The turn is from the bucket's own
-- time, so a clock that stepped back gives no earlier turn, and on a whole ms, a little after
-- the token: what the bucket gained meanwhile over its burst is lost, as it would be to a
-- full bucket.
local function key_take(b)
  if b.tokens >= 1 - 1e-9 then
    b.tokens = b.tokens - 1
    return nil
  end
  local turn = b.at + math.ceil((1 - b.tokens) * key_step - 1e-9)
  local over = b.tokens + (turn - b.at) * key_rate / 1000 - key_burst
  b.tokens = b.tokens - 1
  if over > 0 then b.tokens = b.tokens - over end
  return turn
end
-- Writes the buckets of `order` back.
local function key_buckets_write(flow_key, buckets, order)
  local writes = {}
  for _, key in ipairs(order) do
    local b = buckets[key]
    writes[#writes + 1] = 'k:' .. key
    writes[#writes + 1] = string.format('%.17g %d %.17g', b.tokens, b.at,
      b.at + math.max(0, 1 - b.tokens) * key_step)
  end
  if #writes > 0 then redis.call('HSET', flow_key, unpack(writes)) end
end
