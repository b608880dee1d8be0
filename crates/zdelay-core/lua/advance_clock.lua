-- advance_clock: moves a namespace's test clock forward. A namespace created with a test
-- clock (`clock` = `test` in its schema) reads "now" as Redis TIME plus the offset in the
-- schema's `clock_ms`; this adds to that offset, never subtracts, so the clock only moves
-- forward and every reader agrees on it.
-- KEYS[1] schema  HASH  zdelay:schema   `clock` = "test", `clock_ms` = the offset, ms
-- ARGV[1] how far to move, ms: a whole number above 0
-- ARGV[2] the wake channel (zdelay:wake): "clock <offset ms>" is published on it, so that
--   every daemon wakes and looks again at once
-- Returns: the new offset, ms. Errors, writing nothing: ZDELAY_NO_TEST_CLOCK … (the namespace
--   has none, or does not exist), ZDELAY_BAD_REQUEST duration: … (not a whole number above 0).
-- Re-run safety: no: each run moves the clock again (a caller that cannot tell whether it
--   ran reads the offset with `zdelay clock show`).
if redis.call('HGET', KEYS[1], 'clock') ~= 'test' then
  return redis.error_reply('ZDELAY_NO_TEST_CLOCK the namespace was created without one')
end
local ms = tonumber(ARGV[1])
if not ms or ms < 1 or ms ~= math.floor(ms) or ms > 9007199254740991 then
  return redis.error_reply('ZDELAY_BAD_REQUEST duration: must be a whole number of ms above 0, got ' .. tostring(ARGV[1]))
end
local offset = redis.call('HINCRBY', KEYS[1], 'clock_ms', ms)
redis.call('PUBLISH', ARGV[2], 'clock ' .. offset)
return offset
