-- schedule_request_done: a daemon applied the requests of a schedule up to a sequence number:
-- removes them unless a newer request came meanwhile (it stays, to be applied next), and
-- records the outcome for the producer waiting on it (an outcome never replaces a newer one).
-- KEYS[1] requests HASH {zdelay}:sched_requests
-- KEYS[2] results  HASH {zdelay}:sched_results
-- ARGV[1] schedule id; ARGV[2] the sequence number applied; ARGV[3] the outcome, JSON with
--   that "seq"
-- Returns: 1 the request was removed, 0 a newer one waits.
-- Re-run safety: yes.
local id, seq = ARGV[1], tonumber(ARGV[2])
local function seq_of(text)
  if not text then return nil end
  local ok, decoded = pcall(cjson.decode, text)
  if ok and type(decoded) == 'table' then return tonumber(decoded.seq) end
  return nil
end
local removed = 0
local current = redis.call('HGET', KEYS[1], id)
if current and (seq_of(current) or -1) <= seq then
  redis.call('HDEL', KEYS[1], id)
  removed = 1
end
local last = seq_of(redis.call('HGET', KEYS[2], id))
if not last or last <= seq then
  redis.call('HSET', KEYS[2], id, ARGV[3])
end
return removed
