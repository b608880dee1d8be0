-- Included by enqueue_jobs and enqueue_lane after their checks, fences and enqueue_policy:
-- the answers, debounce, unique windows and the wake-up are the same in a spread shard and in
-- a route lane; only what a job stores differs. The includer names due_key, jobs_key and
-- unique_key, sets stride (ARGV per job, from ARGV[5]: id and due first) and defines
-- leave(id) (an existing job leaves its other state before it is replaced) and store(i, id,
-- exists) (writes job i's stored value and what goes with it, from its arguments at ARGV[i]).

local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
local head_score = head[2] and tonumber(head[2]) or nil
local earliest = nil
local out = {}
for i = 5, #ARGV, stride do
  local id, due_arg = ARGV[i], ARGV[i + 1]
  local due
  if string.sub(due_arg, 1, 1) == '+' then
    due = now_ms + tonumber(string.sub(due_arg, 2))
  else
    due = tonumber(due_arg)
  end
  -- A waiting or dead job keeps its value in jobs: one lookup answers "exists".
  local exists = redis.call('HEXISTS', jobs_key, id) == 1
  if remembered and live_window('u:' .. id) then
    out[#out + 1] = 3
  elseif exists and policy == 'keep' then
    out[#out + 1] = 0
  elseif exists and policy == 'error' then
    out[#out + 1] = -1
  else
    if max_wait then
      -- Debounce: a waiting job's due never passes its first enqueue plus max_wait (or, once
      -- that has passed, its due as it stands); any other starts a window of its own.
      local waiting = exists and redis.call('ZSCORE', due_key, id)
      local deadline
      if waiting then
        deadline = live_window('d:' .. id) or tonumber(waiting)
      else
        deadline = now_ms + max_wait
        redis.call('ZADD', windows_key, deadline, 'd:' .. id)
      end
      if due > deadline then due = deadline end
    end
    if exists then leave(id) end
    store(i, id, exists)
    redis.call('ZADD', due_key, due, id)
    -- A replacement without a window of its own keeps the earlier job's window; a new job has
    -- only its own (an entry a cancel without the unique key left behind goes).
    if unique_for then
      redis.call('HSET', unique_key, id, unique_for)
    elseif unique_key and not exists then
      redis.call('HDEL', unique_key, id)
    end
    if earliest == nil or due < earliest then earliest = due end
    out[#out + 1] = exists and 2 or 1
  end
end
if earliest ~= nil and (head_score == nil or earliest < head_score) then
  redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. string.format('%d', earliest))
end
return out
