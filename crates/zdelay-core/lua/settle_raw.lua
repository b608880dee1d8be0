-- settle_raw: record what a two-phase sink did with raw members it claimed (claim_raw), fenced
-- by the lease: a member is settled only if its score is still the lease deadline it was
-- claimed with; otherwise its lease ran out (it may be claimed again) or a producer
-- rescheduled it, and this settle must not touch it.
-- KEYS[1] source        ZSET  delayed:events
-- KEYS[2] dead          ZSET  delayed:events:dead
-- KEYS[3] dead reasons  HASH  delayed:events:dead:reasons
-- KEYS[4] claims        HASH  delayed:events:claims    sha1(member) -> "<due ms> <attempts> <score set>
--                                                      <last lease ms>"
-- ARGV[1] lease deadline as claim_raw returned it (the fencing token); ARGV[2] unit "ms" | "s"
-- ARGV[3..] quadruples: op, member, a, b
--   "ack"     delivered: the member leaves the source                        (a, b unused)
--   "retry"   due again at a (ms) after a transient failure; one more attempt is counted
--   "release" the sink is unavailable: due again at its original due a (ms), so it keeps its
--             place; no attempt counted
--   "dead"    a = reason
--   (b is unused; the quadruple keeps one shape for every op)
-- A member that is no longer in the source (a producer removed it while it was leased) is
-- fenced, and its record in KEYS[4] goes with it when this claim wrote it.
-- Returns: { settled, fenced }
-- Re-run safety: yes; after a first run the fence no longer matches.
local src, dead_key, reasons_key, claims_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local deadline, unit_ms = tonumber(ARGV[1]), ARGV[2] == 'ms'
-- @include clock
local now_ms = math.floor(clock_us() / 1000)
local function in_unit(ms)
  if unit_ms then return string.format('%d', ms) end
  return string.format('%.3f', ms / 1000)
end
local settled, fenced = 0, 0
for i = 3, #ARGV, 4 do
  local op, member, a, b = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local score = redis.call('ZSCORE', src, member)
  local sha = redis.sha1hex(member)
  if score and tonumber(score) == deadline then
    if op == 'ack' then
      redis.call('ZREM', src, member)
      redis.call('HDEL', claims_key, sha)
    elseif op == 'retry' or op == 'release' then
      local known = redis.call('HGET', claims_key, sha) or ''
      local due, attempts, _, last = string.match(known, '^(%-?%d+) (%d+) (%S+) ?(%S*)$')
      due, attempts = due or string.format('%d', tonumber(a)), tonumber(attempts or '0')
      local at = in_unit(tonumber(a))
      if op == 'retry' then attempts = attempts + 1 end
      redis.call('ZADD', src, 'XX', at, member)
      -- The last lease stays: claim_raw never gives the member that deadline again.
      local lease = (last and last ~= '') and (' ' .. last) or ''
      redis.call('HSET', claims_key, sha, due .. ' ' .. attempts .. ' ' .. at .. lease)
    else
      redis.call('ZREM', src, member)
      redis.call('HDEL', claims_key, sha)
      redis.call('ZADD', dead_key, now_ms, member)
      redis.call('HSET', reasons_key, member, a)
    end
    settled = settled + 1
  else
    if not score then
      -- Gone from the source: its record is of no use, unless a later claim wrote it.
      local known = redis.call('HGET', claims_key, sha)
      local set = known and string.match(known, '^%-?%d+ %d+ (%S+)')
      if set and tonumber(set) == deadline then redis.call('HDEL', claims_key, sha) end
    end
    fenced = fenced + 1
  end
end
return { settled, fenced }
