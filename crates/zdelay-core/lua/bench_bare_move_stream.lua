-- bench_bare_move_stream: the benchmark's baseline for a stream route: id ZSET + payload HASH ->
-- STREAM, one XADD per job with the two fields every entry has (payload, zdelay-id).
-- KEYS[1] due ZSET (member = id, score = due ms); KEYS[2] HASH id -> payload; KEYS[3] stream
-- ARGV[1] batch size; ARGV[2] max score
-- Returns: the number of jobs moved. Re-run safety: yes.
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
local n = #items / 2
if n == 0 then return 0 end
local ids = {}
for i = 1, n do ids[i] = items[2 * i - 1] end
local payloads = redis.call('HMGET', KEYS[2], unpack(ids))
for i = 1, n do
  local zdelay_id = ids[i] .. ':' .. items[2 * i]
  redis.call('XADD', KEYS[3], '*', 'payload', payloads[i], 'zdelay-id', zdelay_id)
end
redis.call('HDEL', KEYS[2], unpack(ids))
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1)
return n
