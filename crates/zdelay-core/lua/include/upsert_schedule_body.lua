-- Included after their fences by upsert_schedule and upsert_schedule_lane: a schedule's keys
-- are the same in a shard and in a route lane, and so is what is done with them.

local id, expected, read_mark, mode = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[7]
local current = redis.call('HGET', KEYS[1], id)
local version = current and tonumber(string.match(current, '^(%d+)\n')) or 0
if version ~= expected then return { -1, version } end
local mark = tonumber(redis.call('ZSCORE', KEYS[4], id))
if mark ~= tonumber(read_mark) then return { -1, version } end
local pending = redis.call('ZSCORE', KEYS[3], id)
-- Quarantined since it was read: there is no pending occurrence to keep.
if (mode == 'keep' or mode == 'same') and not pending and redis.call('HEXISTS', KEYS[5], id) == 1 then
  return { -1, version }
end
if mode == 'same' then
  local env = ARGV[6]
  if env == '' or (redis.call('HSTRLEN', KEYS[2], id) == #env and redis.call('HGET', KEYS[2], id) == env) then
    return { version, pending or '' }
  end
  mode = 'keep'
end
-- Occurrences a firing wrote ahead of their time and that still wait (ARGV[12..], the latest
-- ones: the caller read them waiting): taken back, so that they are fired again under what
-- is written now (or not at all), and the mark goes back to just before them (ARGV[11]).
-- One that no longer waits (moved since it was read) is stale: read again.
local withdrawing = #ARGV - 11
if withdrawing > 0 then
  for from = 1, withdrawing, 1000 do
    local to = math.min(from + 999, withdrawing)
    local scores = redis.call('ZMSCORE', withdraw_due, unpack(ARGV, 11 + from, 11 + to))
    for k = 1, to - from + 1 do
      if not scores[k] then return { -1, version } end
    end
  end
  mark = tonumber(ARGV[11])
end
local next_ms = tonumber(mode)
-- INVARIANT: a pending occurrence is after the mark, so no occurrence is written twice.
if next_ms and mark and next_ms <= mark then return { -1, version } end
if withdrawing > 0 then
  for k = 12, #ARGV do withdraw(ARGV[k]) end
  redis.call('ZADD', KEYS[4], ARGV[11], id)
  -- Fired once each, when they fire again: not counted twice.
  local health = redis.call('HGET', KEYS[7], id)
  local fired, rest = string.match(health or '', '^(%d+)(.*)$')
  if fired then
    redis.call('HSET', KEYS[7], id, math.max(0, tonumber(fired) - withdrawing) .. rest)
  end
end
if current then
  version = version + 1
else
  -- A new schedule's version is Redis's clock in microseconds, not 1: an id deleted and
  -- written again never reuses a version that a firing read before the delete (its fence)
  -- or a daemon's compiled definitions may still hold.
  version = clock_us()
end
-- '%d': Lua writes a number of over 14 digits in exponent form.
redis.call('HSET', KEYS[1], id, string.format('%d', version) .. '\n' .. ARGV[5])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[2], id, ARGV[6]) end
redis.call('HDEL', KEYS[5], id)
if not current then redis.call('ZADD', KEYS[4], 'GT', ARGV[8], id) end
if mode == 'pause' then
  redis.call('ZREM', KEYS[3], id)
  pending = nil
elseif mode ~= 'keep' then
  -- The later of Redis TIME and the caller's now (ARGV[8]): a test clock's time is ahead.
  local now = math.max(math.floor(clock_us() / 1000), tonumber(ARGV[8]))
  local due = tonumber(pending)
  if due and due <= now and due > -math.huge and due == math.floor(due) then
    -- Due already (no daemon fired it yet): left for the mover's plan.
  elseif next_ms then
    local head = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    redis.call('ZADD', KEYS[3], next_ms, id)
    pending = mode
    if not head[2] or next_ms < tonumber(head[2]) then
      redis.call('PUBLISH', ARGV[9], ARGV[10] .. ' ' .. mode)
    end
  else
    redis.call('ZREM', KEYS[3], id)
    pending = nil
  end
end
return { version, pending or '' }
