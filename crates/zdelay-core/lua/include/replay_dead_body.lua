-- Included after their fences by replay_dead and replay_dead_lane: replaying a dead job is the
-- same in a spread shard and in a route lane (its due, its history of deaths, the selection by
-- death time, the wake-up); only what is done to the stored job first differs. The includer
-- names its keys (due_key, dead_key, reasons_key, history_key), sets cap (deaths kept in a
-- history) and first_id (the ARGV index of the first id), and defines revive(id): false when
-- no job is stored under id (an orphan, left dead), else readies it to wait again.

local due = ARGV[2]
if due == '' or string.sub(due, 1, 1) == '+' then
  -- Redis TIME: a caller on a test clock sends its time (the daemon's and the CLI's do).
  local now = math.floor(clock_us() / 1000)
  due = now + (tonumber(string.sub(due, 2)) or 0)
else
  due = tonumber(due)
end
local MAX_REASON = 500

-- Appends the job's current death to its history, keeping the last `cap`.
local function remember(id, died)
  local reason = redis.call('HGET', reasons_key, id) or ''
  reason = string.gsub(reason, '[\r\n]', ' ')
  if #reason > MAX_REASON then reason = string.sub(reason, 1, MAX_REASON) end
  local lines = {}
  local old = redis.call('HGET', history_key, id)
  if old then
    for line in string.gmatch(old, '[^\n]+') do lines[#lines + 1] = line end
  end
  lines[#lines + 1] = string.format('%d', tonumber(died)) .. ' ' .. reason
  local first = #lines - cap + 1
  if first < 1 then first = 1 end
  redis.call('HSET', history_key, id, table.concat(lines, '\n', first, #lines))
end

local replayed, orphans, skipped = 0, 0, 0
for i = first_id, #ARGV, 2 do
  local id, selected = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', dead_key, id)
  if not score or (selected ~= '' and tonumber(score) ~= tonumber(selected)) then
    skipped = skipped + 1
  elseif revive(id) then
    remember(id, score)
    redis.call('ZREM', dead_key, id)
    redis.call('HDEL', reasons_key, id)
    redis.call('ZADD', due_key, due, id)
    replayed = replayed + 1
  else
    orphans = orphans + 1
  end
end
if replayed > 0 then redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. string.format('%d', due)) end
return { replayed, orphans, skipped, due }
