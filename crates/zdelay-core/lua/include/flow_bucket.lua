-- Included by the scripts that apply a route's rate (`-- @include flow_bucket`): move_lane
-- (a local route's lane) and take_flow (a two-phase route's bucket). One bucket, one place.

-- A route's rate is a token bucket holding `capacity` tokens: the burst, but at least one job
-- plus MIN_BUCKET_MS of the rate. A daemon wakes a held route on a millisecond timer that can
-- be a few ms late; a bucket that fills while it wakes loses the tokens that come meanwhile,
-- and the route falls short of its rate (at 1000/s with burst 1 it would move one job per
-- wake-up). A held route is called again once it has `want` tokens, which leaves at least
-- WAKE_SLACK_MS of the rate's room in the bucket for the wake-up to be late in without
-- losing any.
local MIN_BUCKET_MS, WAKE_SLACK_MS = 10, 5
local function bucket_capacity(rate, burst)
  return math.max(burst, 1 + rate * MIN_BUCKET_MS / 1000)
end
-- The bucket at now_ms from its stored state (nil, nil: never used, full): its tokens, the
-- ms it was refilled at, and its whole tokens. It refills on Redis's clock, shared by every
-- daemon, and never for a clock that stepped back (nothing until it passes the last refill).
local function bucket_refill(rate, capacity, tokens, at, now_ms)
  tokens, at = tokens or capacity, at or now_ms
  if now_ms > at then
    tokens = tokens + (now_ms - at) * rate / 1000
    at = now_ms
  end
  tokens = math.min(capacity, tokens)
  -- The epsilon absorbs the refill's rounding (0.9999999 tokens is one).
  return tokens, at, math.max(0, math.floor(tokens + 1e-9))
end
-- When a route the bucket holds may move again: once the bucket has its next tenth of a
-- second of tokens (at most a batch, with room left for a late wake-up; at least one job).
-- From the bucket's own time: after a clock that stepped back, later than now says.
local function bucket_wake(rate, capacity, tokens, at, batch)
  local want = math.min(batch, rate / 10, capacity - rate * WAKE_SLACK_MS / 1000)
  want = math.max(1, math.floor(want))
  return at + math.max(1, math.ceil((want - tokens) * 1000 / rate))
end
