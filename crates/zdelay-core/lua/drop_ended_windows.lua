-- drop_ended_windows: drops unique windows and debounce deadlines that ended from a windows set,
-- the oldest first, at most ARGV[1] of them. The enqueues drop some at each call; this is for
-- the sets no enqueue reaches (a removed route's lane, a retired lane, a quiet shard).
-- KEYS[1] windows ZSET  a shard's or a lane's windows ("u:<id>"/"d:<id>" -> ms the window ends)
-- ARGV[1] the most to drop
-- Returns: { how many were dropped, how many that ended are left }
-- Re-run safety: yes.
-- @include clock
-- Redis TIME: behind a test clock's time (whose windows then wait a little longer to be dropped;
-- enqueues read a window's end against their own time).
local now_ms = math.floor(clock_us() / 1000)
local ended = redis.call('ZCOUNT', KEYS[1], '-inf', now_ms)
local n = math.min(ended, tonumber(ARGV[1]))
if n > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1) end
return { n, ended - n }
