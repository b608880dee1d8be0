-- fire_schedules: turn due occurrences of recurring schedules into jobs, raise each
-- schedule's high-water mark and write its pending occurrence, in one step: a crash never
-- loses a schedule or forks it. The caller planned each schedule (misfire policy, max
-- lateness, the next occurrence) from what due_schedules read; a schedule whose pending
-- occurrence or version changed since (another daemon fired it, an update, a delete) is left
-- alone ("fenced"). A schedule the caller could not read is quarantined instead: taken off
-- its timeline with a reason, until `schedule set` writes it again.
-- Each occurrence becomes an ordinary job with its own id (keys::occurrence_id: in the
-- schedule's shard), due at its occurrence time and carrying the schedule's envelope, so
-- move_due delivers it like any job (exactly once to a local list, fenced to a sink).
-- INVARIANT: an occurrence at or before the schedule's mark is never written (it was
-- decided once already), and the mark only rises: no occurrence is ever written twice.
-- A call writes at most 1000 occurrences (refused otherwise): a big catch-up is split by the
-- caller over several calls, each leaving the next unwritten occurrence pending (still due),
-- so a crash between calls loses nothing and repeats nothing.
-- KEYS[1] due          ZSET {zdelay:3}:due
-- KEYS[2] jobs         HASH {zdelay:3}:jobs
-- KEYS[3] dead         ZSET {zdelay:3}:dead
-- KEYS[4] reasons      HASH {zdelay:3}:reasons
-- KEYS[5] max_lateness HASH {zdelay:3}:max_lateness
-- KEYS[6] schedules    HASH {zdelay:3}:schedules  id -> "<version>\n<definition JSON>"
-- KEYS[7] sched_env    HASH {zdelay:3}:sched_env  id -> the occurrences' envelope
-- KEYS[8] sched_due    ZSET {zdelay:3}:sched_due  id -> pending occurrence ms
-- KEYS[9] sched_fired  ZSET {zdelay:3}:sched_fired id -> high-water mark ms
-- KEYS[10] sched_quarantine HASH {zdelay:3}:sched_quarantine id -> "<ms> <reason>"
-- KEYS[11] shards   STRING {zdelay:3}:shards the shard's marker (shard_fence)
-- KEYS[12] sched_health HASH {zdelay:3}:sched_health id -> health record (fire_schedules_body)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] now ms (when occurrences expired die, when a quarantine began)
-- ARGV[3] mark retention ms: marks older than now minus this are pruned, at most 100 a call
-- ARGV[4..] per schedule: id, its pending occurrence as due_schedules read it (the exact
--   score text), version read ("" when the definition has none), the mark to set ("" =
--   leave it), next pending occurrence ms ("" = none: ended), max lateness ms ("" = none),
--   quarantine reason ("" = none; otherwise nothing else applies), occurrences missed (passed
--   over by the misfire policy), occurrences skipped by calendar, D, then D triples (job id,
--   occurrence ms, due ms: the occurrence, or later by the schedule's jitter) to deliver, E, then E pairs (job id, occurrence ms) expired
-- Returns: { jobs created, occurrences expired, schedules fenced, occurrences missed,
--   occurrences skipped by calendar, 0, 0, 0, 0 (nothing is pushed onto a list here:
--   fire_schedules_lane's reply shape), then for each schedule quarantined its id and the
--   reason };
--   error ZDELAY_FIRE_BOUND <n> (nothing written) when the call carries more than 1000
--   occurrences.
-- Re-run safety: yes; the first run moved each schedule's pending occurrence, so a re-run is
--   fenced, and no occurrence at or before the mark is written.
local shard_marker = KEYS[11]
-- @include shard_fence
local due_key, jobs_key, dead_key, reasons_key, limit_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local schedules_key, env_key, sched_due_key = KEYS[6], KEYS[7], KEYS[8]
local fired_key, quarantine_key, health_key = KEYS[9], KEYS[10], KEYS[12]
-- An occurrence is a job of the shard carrying the schedule's envelope (its sink publishes
-- it: never pushed onto a list here).
local FIRST, direct = 4, nil
local function split(envelope) return envelope, '' end
local function write_job(job, envelope) return redis.call('HSETNX', jobs_key, job, envelope) == 1 end
local function waiting(_, _) end
-- @include fire_schedules_body
