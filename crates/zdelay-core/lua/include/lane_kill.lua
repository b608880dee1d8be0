-- Included by move_lane (per-key rates) and route_gone_lane (`-- @include lane_kill`): sends
-- waiting ids of a lane to dead with one reason. Needs the locals due_key, maxlate_key,
-- large_key, dead_key, reasons_key, now_ms and remember (include remember).

-- As every dead job: payload and meta kept for replay, its max lateness and large-set entry
-- gone with it, its unique window remembered.
local function kill_waiting(ids, why)
  local zargs, hargs = {}, {}
  for j = 1, #ids do
    zargs[#zargs + 1] = now_ms
    zargs[#zargs + 1] = ids[j]
    hargs[#hargs + 1] = ids[j]
    hargs[#hargs + 1] = why
  end
  redis.call('ZADD', dead_key, unpack(zargs))
  redis.call('HSET', reasons_key, unpack(hargs))
  redis.call('ZREM', due_key, unpack(ids))
  redis.call('HDEL', maxlate_key, unpack(ids))
  redis.call('SREM', large_key, unpack(ids))
  remember(ids)
end
