-- bench_bare_move_raw: the benchmark's baseline, the least a ZSET -> LIST move can do.
-- KEYS[1] source ZSET (member = payload); KEYS[2] list
-- ARGV[1] batch size; ARGV[2] max score
-- Returns: the number of members moved. Re-run safety: yes.
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[1]))
if #items == 0 then return 0 end
redis.call('LPUSH', KEYS[2], unpack(items))
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #items - 1)
return #items
