-- bench_bare_move_hash: the benchmark's baseline for envelope jobs: id ZSET + payload HASH -> LIST.
-- KEYS[1] due ZSET (member = id); KEYS[2] HASH id -> payload; KEYS[3] list
-- ARGV[1] batch size; ARGV[2] max score
-- Returns: the number of jobs moved. Re-run safety: yes.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[1]))
if #ids == 0 then return 0 end
local payloads = redis.call('HMGET', KEYS[2], unpack(ids))
redis.call('LPUSH', KEYS[3], unpack(payloads))
redis.call('HDEL', KEYS[2], unpack(ids))
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #ids - 1)
return #ids
