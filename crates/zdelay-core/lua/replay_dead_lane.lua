-- replay_dead_lane: make a route lane's dead jobs due again (storage layout 2). The death each
-- leaves is appended to its history, as replay_dead does: "<died ms> <reason>" (newlines in the
-- reason turned to spaces, at most 500 bytes of it), one entry a line, oldest first, only the
-- last ARGV[5] entries kept. Local routes count no delivery attempts, so there is no attempt
-- count to reset. A payload over 4096 bytes is listed in the large set again (the move reads
-- the lane in smaller chunks while it holds any).
-- KEYS[1] due      ZSET   zdelay:{emj}:due:<route>      member = stored id, score = due ms
-- KEYS[2] jobs     HASH   zdelay:{emj}:jobs:<route>     stored id -> payload (raw bytes)
-- KEYS[3] large    SET    zdelay:{emj}:large:<route>    stored ids whose payload is over 4096 bytes
-- KEYS[4] dead     ZSET   zdelay:{emj}:dead:<route>     member = stored id, score = ms it died
-- KEYS[5] reasons  HASH   zdelay:{emj}:reasons:<route>  stored id -> why it died
-- KEYS[6] history  HASH   zdelay:{emj}:history:<route>  stored id -> its earlier deaths
-- KEYS[7] marker   STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] due for the replayed jobs: "" = Redis TIME (now), "<ms>" = epoch ms, "+<ms>" = that
--   many ms after Redis TIME
-- ARGV[3] wake channel; ARGV[4] the lane's wake name ("l<lane>")
-- ARGV[5] history entries kept per id (the oldest are dropped)
-- ARGV[6..] pairs: stored id, the dead score it was selected with ("" = whatever its score)
-- Returns: { replayed, orphans, skipped, due ms } as replay_dead: orphans are dead ids without a
--   payload (they stay dead: there is nothing to deliver); skipped are ids that are not dead,
--   or died again since they were selected (their score moved).
-- Re-run safety: yes; a replayed job is no longer dead, so a second run skips it.

local lane_marker = KEYS[7]
-- @include lane_fence
local due_key, jobs_key, large_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local due = ARGV[2]
if due == '' or string.sub(due, 1, 1) == '+' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  due = now + (tonumber(string.sub(due, 2)) or 0)
else
  due = tonumber(due)
end
local cap = tonumber(ARGV[5])
local MAX_REASON = 500
local SMALL = 4096

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
for i = 6, #ARGV, 2 do
  local id, selected = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', dead_key, id)
  if not score or (selected ~= '' and tonumber(score) ~= tonumber(selected)) then
    skipped = skipped + 1
  elseif redis.call('HEXISTS', jobs_key, id) == 1 then
    if redis.call('HSTRLEN', jobs_key, id) > SMALL then redis.call('SADD', large_key, id) end
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
