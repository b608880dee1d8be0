-- fire_schedules: turn due occurrences of recurring schedules into jobs and write each
-- schedule's next occurrence, in one step: a crash never loses a schedule or forks it. The
-- caller planned each schedule (misfire policy, max lateness, next occurrence) from what
-- due_schedules read; a schedule whose occurrence or version changed since (another daemon
-- fired it, an update, a delete) is left alone ("fenced").
-- Each occurrence becomes an ordinary job with its own id (keys::occurrence_id: in the
-- schedule's shard), due at its occurrence time and carrying the schedule's envelope, so
-- move_due delivers it like any job (exactly once to a local list, fenced to a sink).
-- KEYS[1] due          ZSET {zdelay:3}:due
-- KEYS[2] jobs         HASH {zdelay:3}:jobs
-- KEYS[3] dead         ZSET {zdelay:3}:dead
-- KEYS[4] reasons      HASH {zdelay:3}:reasons
-- KEYS[5] max_lateness HASH {zdelay:3}:max_lateness
-- KEYS[6] schedules    HASH {zdelay:3}:schedules  id -> "<version>\n<definition JSON>"
-- KEYS[7] sched_env    HASH {zdelay:3}:sched_env  id -> the occurrences' envelope
-- KEYS[8] sched_due    ZSET {zdelay:3}:sched_due  id -> next occurrence ms
-- KEYS[9] shards    STRING {zdelay:3}:shards layout marker: the shard count once resharded, or
--                                           "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs
-- ARGV[2] now ms (when occurrences expired die)
-- ARGV[3..] per schedule: id, the occurrence ms read, version read ("" for a schedule whose
--   definition is missing or unreadable: it is taken off the timeline), next occurrence ms
--   ("" = ended), max lateness ms ("" = none), D, then D pairs (job id, occurrence ms) to
--   deliver, E, then E pairs (job id, occurrence ms) expired
-- Returns: { jobs created, occurrences expired, schedules fenced }
-- Re-run safety: yes; the first run moved each schedule's occurrence, so a re-run is fenced,
--   and an occurrence job that exists is never written twice.
-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[9])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local due_key, jobs_key, dead_key, reasons_key, limit_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local schedules_key, env_key, sched_due_key = KEYS[6], KEYS[7], KEYS[8]
local now = tonumber(ARGV[2])
local created, expired, fenced = 0, 0, 0
local i = 3
while i <= #ARGV do
  local id, read_due, read_version, next_ms, limit = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local deliver = tonumber(ARGV[i + 5])
  local first_deliver = i + 6
  local n_expired = tonumber(ARGV[first_deliver + 2 * deliver])
  local first_expired = first_deliver + 2 * deliver + 1
  i = first_expired + 2 * n_expired
  local score = redis.call('ZSCORE', sched_due_key, id)
  local record = redis.call('HGET', schedules_key, id)
  local version = record and string.match(record, '^(%d+)\n') or ''
  -- Without an envelope there is nothing to deliver: the occurrence is only moved on.
  local envelope = redis.call('HGET', env_key, id)
  if not score or tonumber(score) ~= tonumber(read_due) or version ~= read_version then
    fenced = fenced + 1
  elseif envelope then
    for k = 0, deliver - 1 do
      local job, at = ARGV[first_deliver + 2 * k], ARGV[first_deliver + 2 * k + 1]
      if redis.call('HSETNX', jobs_key, job, envelope) == 1 then
        redis.call('ZADD', due_key, at, job)
        if limit ~= '' then redis.call('HSET', limit_key, job, limit) end
        created = created + 1
      end
    end
    for k = 0, n_expired - 1 do
      local job, at = ARGV[first_expired + 2 * k], ARGV[first_expired + 2 * k + 1]
      if redis.call('HSETNX', jobs_key, job, envelope) == 1 then
        redis.call('ZADD', dead_key, now, job)
        redis.call('HSET', reasons_key, job, 'expired: ' .. (now - tonumber(at)) ..
          ' ms after its occurrence, max_lateness ' .. limit .. ' ms')
        expired = expired + 1
      end
    end
  end
  if version == read_version and score and tonumber(score) == tonumber(read_due) then
    if next_ms == '' then
      redis.call('ZREM', sched_due_key, id)
    else
      redis.call('ZADD', sched_due_key, next_ms, id)
    end
  end
end
return { created, expired, fenced }
