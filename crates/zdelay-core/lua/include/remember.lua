-- Included by the scripts that deliver or kill jobs (`-- @include remember`): remember(ids)
-- records the unique window of each id that leaves for good. Needs the locals unique_key,
-- windows_key and now_ms.

-- unique_for: an id that leaves for good (delivered or dead) and was enqueued with a window is
-- remembered until the window ends; enqueues of it meanwhile are answered as duplicates.
local any_unique = redis.call('EXISTS', unique_key) == 1
local function remember(ids)
  if not any_unique or #ids == 0 then return end
  local windows = redis.call('HMGET', unique_key, unpack(ids))
  local zargs, gone = {}, {}
  for i = 1, #ids do
    if windows[i] then
      zargs[#zargs + 1] = now_ms + tonumber(windows[i])
      zargs[#zargs + 1] = 'u:' .. ids[i]
      gone[#gone + 1] = ids[i]
    end
  end
  if #gone > 0 then
    redis.call('ZADD', windows_key, unpack(zargs))
    redis.call('HDEL', unique_key, unpack(gone))
  end
end
