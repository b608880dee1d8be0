-- bench_bare_move_raw_checked: the raw baseline with the checks a raw source cannot skip. A
-- raw member is written by its producer with a plain ZADD, so nothing has checked its size
-- before the move reads it: the move has to keep each call within the byte budget without
-- reading a member only to leave it, and look at each member's size. So, like move_raw, it
-- reads by rank in chunks of as many members as the rest of the budget holds at the largest
-- payload each (at a sixteenth of it once every member read is that small), looks at each
-- member's size, and pushes each chunk as read; nothing else (no dead letters, lateness,
-- clock, list type or next head).
-- KEYS[1] source ZSET (member = payload); KEYS[2] list
-- ARGV[1] batch size; ARGV[2] max score; ARGV[3] largest payload in bytes; ARGV[4] byte budget
-- Returns: the number of members moved; a member over the largest payload ends the call
-- before it (the bench writes none). Re-run safety: yes.
local batch, max_payload, budget = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
local due = math.min(batch, redis.call('ZCOUNT', KEYS[1], '-inf', ARGV[2]))
local small = max_payload / 16
local n, largest = 0, 0
while n < due do
  local each = max_payload
  if n > 0 and largest <= small then each = small end
  local chunk = math.min(due - n, math.max(1, math.floor(budget / each)))
  local part = redis.call('ZRANGE', KEYS[1], n, n + chunk - 1)
  local take = 0
  for j = 1, #part do
    local size = #part[j]
    if size > max_payload or (size > budget and n + j > 1) then break end
    budget = budget - size
    if size > largest then largest = size end
    take = j
  end
  if take > 0 then redis.call('LPUSH', KEYS[2], unpack(part, 1, take)) end
  n = n + take
  if take < chunk or budget <= 0 then break end
end
if n > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1) end
return n
