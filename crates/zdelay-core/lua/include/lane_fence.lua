-- Included first by every script on a route lane's keys (`-- @include lane_fence`), after
-- `local lane_marker = KEYS[<n>]` names its marker: refuses, writing nothing, a lane that is not
-- the one the caller read from the registry (ARGV[1], the marker it expects).

local marker = redis.call('GET', lane_marker)
if marker ~= ARGV[1] then
  if not marker then return redis.error_reply('ZDELAY_NO_LANE no daemon registered this lane') end
  if string.sub(marker, 1, 8) == 'retired ' then
    return redis.error_reply('ZDELAY_LANE_MOVED ' .. string.sub(marker, 9))
  end
  return redis.error_reply('ZDELAY_LANE_CHANGED ' .. marker)
end
