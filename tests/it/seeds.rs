//! The worked examples (`examples/seeds/<name>/run.sh`, docs/guides/recipes.md): each
//! script runs against a private Redis with the binary under test, must exit 0, and its
//! transcript must match the expected one line for line. Lines starting with `# ` carry what
//! varies between runs (pids, lateness) and are skipped.

use crate::common::{self, RedisServer};
use std::path::PathBuf;
use std::process::Command;

/// Runs one example and returns its transcript without the `# ` lines.
fn run_example(name: &str) -> Vec<String> {
    let redis = RedisServer::start();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("examples/seeds")
        .join(name)
        .join("run.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .env("REDIS_PORT", redis.port.to_string())
        .env("ZDELAY", common::zdelay_bin());
    // The scripts set what they need; nothing from the caller's zdelay settings leaks in.
    for (key, _) in std::env::vars() {
        if key.starts_with("ZDELAY_") {
            cmd.env_remove(key);
        }
    }
    let out = cmd.output().expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name}/run.sh failed ({})\n--- stdout\n{stdout}--- stderr\n{stderr}",
        out.status
    );
    stdout
        .lines()
        .filter(|l| !l.starts_with("# "))
        .map(str::to_owned)
        .collect()
}

/// Compares a transcript with the expected lines, naming the first line that differs. Each
/// line's leading blanks are ignored on both sides (the expected text is indented as code),
/// and so are the expected text's trailing blanks.
fn assert_transcript(name: &str, got: &[String], expected: &str) {
    let want: Vec<&str> = expected.trim().lines().map(str::trim_start).collect();
    let first_diff = (0..got.len().max(want.len()))
        .find(|&i| got.get(i).map(|l| l.trim_start()) != want.get(i).copied());
    if let Some(i) = first_diff {
        panic!(
            "{name}: transcript differs at line {}: got {:?}, expected {:?}\n--- got\n{}\n--- expected\n{}",
            i + 1,
            got.get(i),
            want.get(i),
            got.join("\n"),
            want.join("\n")
        );
    }
}

/// Recipe 000: sharded delay sets, batch dequeue, reclaim TTL. Four raw sources, one per
/// shard; the mover is killed mid-burst and restarted: all 2004 jobs arrive, none twice. A
/// consumer that dies holding a job finds it again in its processing list.
#[test]
fn sharded_delay_queue() {
    let got = run_example("sharded-delay-queue");
    assert_transcript(
        "sharded-delay-queue",
        &got,
        r#"
        == zdelay run: one raw source per delay-set shard, all routed to the list queue:jobs
        == producers: ZADD delay_set_<n % 4> <ready time, epoch s> job-<n>
        ZADD delay_set_0: 500 jobs, ready from 0.3 s to 1.3 s from now
        ZADD delay_set_1: 500 jobs, ready from 0.3 s to 1.3 s from now
        ZADD delay_set_2: 500 jobs, ready from 0.3 s to 1.3 s from now
        ZADD delay_set_3: 500 jobs, ready from 0.3 s to 1.3 s from now
        == the mover is killed (kill -9) as soon as the first jobs arrive
        zdelay killed with SIGKILL after the first jobs arrived
        at the kill, on queue:jobs + still in the delay sets: 2000 of 2000
        job-2001..job-2004 ready while nothing moves: 4 of 4 wait in their delay sets
        == restart zdelay: it carries on where the killed one stopped
        queue:jobs: 2004 members, 2004 distinct; delay sets: 0 left
        == worker w1: BLMOVE queue:jobs -> queue:jobs:processing:w1, handle, LREM to acknowledge
        w1 took 3 jobs, acknowledged 2, died holding 1: queue:jobs:processing:w1 has 1
        == w1 restarts: first what its processing list still holds, then the queue
        found 1 unacknowledged job in queue:jobs:processing:w1, handled it again, acknowledged it
        handled 2005 times: 2004 distinct jobs; handled twice: the job w1 died holding
        queue:jobs: 0, queue:jobs:processing:w1: 0
        every job from job-1 to job-2004 handled
        zdelay stopped (SIGTERM, exit 0)
        OK
        "#,
    );
}

/// Recipe 003: enqueue = ZADD / `zdelay enqueue --at`, remove = ZREM / `zdelay cancel`,
/// get_expired = the daemon. Expired objects arrive in due order; removed ones never do, even
/// though later objects of the same source and shard did.
#[test]
fn scheduler_primitives() {
    let got = run_example("scheduler-primitives");
    assert_transcript(
        "scheduler-primitives",
        &got,
        r#"
        == keyspace notifications for sorted sets, so a ZADD wakes zdelay
        notify-keyspace-events includes K and z
        == zdelay run: raw source scheduled_objects and the route expired -> queue:expired
        zdelay listens on __keyspace@0__:scheduled_objects and zdelay:wake
        == enqueue(object, expiring_time): ZADD, or zdelay enqueue --at
        $ redis-cli ZADD scheduled_objects <T+0ms> obj-a
        1
        (exit 0)
        $ zdelay enqueue --dest expired --id obj-c --at <T+300ms> --payload obj-c
        obj-c
        (exit 0)
        $ redis-cli ZADD scheduled_objects <T+600ms> obj-b
        1
        (exit 0)
        $ zdelay enqueue --dest expired --id obj-d --at <T+900ms> --payload obj-d
        obj-d
        (exit 0)
        $ redis-cli ZADD scheduled_objects <T+1200ms> obj-e
        1
        (exit 0)
        $ zdelay enqueue --dest expired --id obj-f --at <T+1500ms> --payload obj-f
        obj-f
        (exit 0)
        == remove(object) before it expires: ZREM, or zdelay cancel
        $ redis-cli ZREM scheduled_objects obj-b
        1
        (exit 0)
        $ zdelay cancel obj-d
        cancelled obj-d
        (exit 0)
        == get_expired(): nothing to poll, the consumer blocks in BRPOP queue:expired
        queue:expired <- obj-a
        queue:expired <- obj-c
        queue:expired <- obj-e
        queue:expired <- obj-f
        == removed objects never expire
        queue:expired holds 0, scheduled_objects holds 0
        $ zdelay get obj-d
        (exit 3)
        == remove(object) after it expired: nothing left to remove
        $ redis-cli ZREM scheduled_objects obj-a
        0
        (exit 0)
        $ zdelay cancel obj-c
        (exit 3)
        == no polling worker: zdelay was woken by the writes themselves
        woken by keyspace notifications: yes
        woken by enqueues: yes
        zdelay stopped (SIGTERM, exit 0)
        OK
        "#,
    );
}

/// Recipe 004 (Redis in Action 6.4.2): per-queue routes with `delayed_suffix = "-delayed"`;
/// a worker's BLPOP serves each lane before its queue, high before medium before low, and a
/// lane in due order. Two daemons on one Redis move each task once, with no lock.
#[test]
fn delayed_priority_queues() {
    let got = run_example("delayed-priority-queues");
    assert_transcript(
        "delayed-priority-queues",
        &got,
        r#"
        == zdelay run: routes high, medium, low (rpush, delayed_suffix "-delayed"), source delayed:low
        == a task to run now: RPUSH onto its queue, as before
        RPUSH queue:high h-now
        RPUSH queue:medium m-now-1
        RPUSH queue:medium m-now-2
        RPUSH queue:low l-now
        == a task for later: zdelay enqueue --dest <queue> --in <delay>, or ZADD delayed:low
        zdelay enqueue --dest high --in 300ms h-later
        zdelay enqueue --dest medium --id {medium}:m-later-1 --in 300ms m-later-1
        zdelay enqueue --dest medium --id {medium}:m-later-2 --in 400ms m-later-2
        ZADD delayed:low <now + 0.35 s> l-later
        == due tasks land in the -delayed lanes, in due order
        queue:high-delayed: h-later
        queue:medium-delayed: m-later-1 m-later-2
        queue:low-delayed: l-later
        == a worker: BLPOP queue:high-delayed queue:high queue:medium-delayed queue:medium queue:low-delayed queue:low
        queue:high-delayed -> h-later
        queue:high -> h-now
        queue:medium-delayed -> m-later-1
        queue:medium-delayed -> m-later-2
        queue:medium -> m-now-1
        queue:medium -> m-now-2
        queue:low-delayed -> l-later
        queue:low -> l-now
        left in the six lists: 0
        == two daemons on one Redis, no lock: each task is moved once
        zdelay enqueue --batch: 500 tasks for medium, due in 300 ms
        queue:medium-delayed: 500 tasks, 500 distinct
        both daemons stopped (SIGTERM, exit 0)
        OK
        "#,
    );
}

/// Recipe 001 (Schedulinator): recurring tasks fired by three instances sharing the shards,
/// one stopped halfway: each of 30 occurrences called once on a second Redis (a two-phase
/// `redis` sink). The service refusing calls (OOM): one occurrence retried with exponential
/// backoff and full jitter under one idempotency key until it is dead, the schedule kept on
/// its grid, the dead one replayed. The service down: occurrences wait, no attempt used.
#[test]
fn recurring_tasks() {
    let got = run_example("recurring-tasks");
    assert_transcript(
        "recurring-tasks",
        &got,
        r##"
        == the service the tasks call: a second Redis; a call is an RPUSH onto its list calls
        service up; calls holds 0
        == many instances: zdelay run x3 on one namespace, the 4 shards dealt among them
        zdelay stats: 3 instances, each shard polled by exactly one of them
        == zadd schedules <time> task<n> becomes zdelay schedule set: every 500 ms, from T for 3 s
        $ zdelay schedule set task1 --dest calls --every 500ms --start-at <T> --end-at <T+3000ms> --misfire catch_up --payload task1
        created task1; next occurrence <T+0ms> (<T+0ms>)
        (exit 0)
        $ zdelay schedule set task2 --dest calls --every 500ms --start-at <T> --end-at <T+3000ms> --misfire catch_up --payload task2
        created task2; next occurrence <T+0ms> (<T+0ms>)
        (exit 0)
        $ zdelay schedule set task3 --dest calls --every 500ms --start-at <T> --end-at <T+3000ms> --misfire catch_up --payload task3
        created task3; next occurrence <T+0ms> (<T+0ms>)
        (exit 0)
        $ zdelay schedule set task4 --dest calls --every 500ms --start-at <T> --end-at <T+3000ms> --misfire catch_up --payload task4
        created task4; next occurrence <T+0ms> (<T+0ms>)
        (exit 0)
        $ zdelay schedule set task5 --dest calls --every 500ms --start-at <T> --end-at <T+3000ms> --misfire catch_up --payload task5
        created task5; next occurrence <T+0ms> (<T+0ms>)
        (exit 0)
        $ zdelay schedule list | sort
        task1  calls  every 500ms  next <T+0ms>
        task2  calls  every 500ms  next <T+0ms>
        task3  calls  every 500ms  next <T+0ms>
        task4  calls  every 500ms  next <T+0ms>
        task5  calls  every 500ms  next <T+0ms>
        (exit 0)
        == one instance stops halfway (SIGTERM): the two others poll its shards
        instance 2 stopped (SIGTERM, exit 0)
        zdelay stats: 2 instances, each shard polled by exactly one of them
        == every occurrence called once, whichever instance fired it
        task1: 6 calls
        task2: 6 calls
        task3: 6 calls
        task4: 6 calls
        task5: 6 calls
        calls holds 30: 5 tasks x 6 occurrences (T, T+500ms, ..., T+2500ms)
        $ zdelay schedule list | sort
        task1  calls  every 500ms  next none
        task2  calls  every 500ms  next none
        task3  calls  every 500ms  next none
        task4  calls  every 500ms  next none
        task5  calls  every 500ms  next none
        (exit 0)
        == the service refuses calls (OOM): retries with exponential backoff and full jitter
        $ redis-cli -p <service> CONFIG SET maxmemory 1
        OK
        (exit 0)
        $ zdelay schedule set report --dest calls --every 3s --start-at <R> --end-at <R+6000ms> --max-attempts 4 --payload report
        created report; next occurrence <R+0ms> (<R+0ms>)
        (exit 0)
        $ zdelay get {report}:<R+0ms>   (fields id, schedule, attempt, max_attempts, state, reason)
        "attempt": 4,
        "id": "{report}:<R+0ms>",
        "max_attempts": 4,
        "reason": "gave up after 4 attempts: \"OOM\": command not allowed when used memory > 'maxmemory'.",
        "schedule": "report",
        "state": "dead",
        (exit 0)
        scheduled due kept while it was retried (zdelay:{<tag>}:s<shard>:scheduled): <R+0ms>
        so each of its calls had the idempotency key report:<R+0ms> (<schedule id>:<occurrence ms>)
        (Kafka, AMQP and NATS messages carry it as zdelay-id / message id; a Redis list gets the payload only)
        the service refused 4 RPUSH calls (INFO commandstats, rejected_calls)
        $ zdelay schedule get report | sed 's/[0-9]*ms late/<n>ms late/'
        report  calls  every 3s  next <R+3000ms>
          fired 2, missed 0, expired 0, skipped by calendar 0; last fired the occurrence of <R+3000ms>, 0s late
        (exit 0)
        $ redis-cli -p <service> CONFIG SET maxmemory 0
        OK
        (exit 0)
        the next occurrence, R+3000ms, went out as planned: calls holds report x1
        $ zdelay dead list | sed 's/  died [^ ]*//'
        {report}:<R+0ms>  shard 0  route calls  attempts 4/4  gave up after 4 attempts: "OOM": command not allowed when used memory > 'maxmemory'.
        (exit 0)
        $ zdelay dead replay --id {report}:<R+0ms>
        replayed 1
        (exit 0)
        calls holds report x2; dead jobs left: 0
        == the service is down: occurrences wait for it, no attempt used up
        service stopped (SIGTERM)
        $ zdelay schedule set ping --dest calls --every 500ms --start-at <P> --end-at <P+2000ms> --payload ping
        created ping; next occurrence <P+0ms> (<P+0ms>)
        (exit 0)
        zdelay stats: sink endpoint (redis): down; 4 jobs waiting
        $ zdelay get {ping}:<P+0ms>   (fields id, schedule, attempt, state, waiting_for_sink)
        "id": "{ping}:<P+0ms>",
        "schedule": "ping",
        "state": "due",
        "waiting_for_sink": "endpoint"
        (exit 0)
        attempts used: 0
        service back on the same port, empty
        calls holds 4: ping x4; sink endpoint (redis): up
        instances and service stopped (SIGTERM, exit 0)
        OK
        "##,
    );
}

/// Recipe 002 (a distributed scheduled queue): cron schedules with seconds fired by three
/// daemons, two per shard and lane, one killed with SIGKILL: 63 occurrences fired and consumed once
/// each. No daemon running while occurrences pass: coalesce, skip and catch_up deliver 1, 0
/// and 3 of 3. A weekday schedule in Europe/Paris keeps one pending occurrence through
/// update, pause, resume and delete.
#[test]
fn distributed_cron() {
    let got = run_example("distributed-cron");
    assert_transcript(
        "distributed-cron",
        &got,
        r##"
        == planning: the cron format with seconds (6 fields), previewed by the daemon's code, no Redis
        $ zdelay schedule preview --cron '*/20 * * * * *' --from 2030-01-01T00:00:00Z --count 4
        2030-01-01T00:00:00+00:00  1893456000000
        2030-01-01T00:00:20+00:00  1893456020000
        2030-01-01T00:00:40+00:00  1893456040000
        2030-01-01T00:01:00+00:00  1893456060000
        (exit 0)
        $ zdelay schedule preview --cron '0 30 9 * * 1-5' --tz Europe/Paris --from 2030-03-29T00:00:00Z --count 3
        2030-03-29T09:30:00+01:00  1901003400000
        2030-04-01T09:30:00+02:00  1901259000000
        2030-04-02T09:30:00+02:00  1901345400000
        (exit 0)
        == the workers: zdelay run x3, each of the 4 shards and the route's lane polled by two of them
        zdelay stats: 3 instances, each shard and lane polled by 2 of them
        == the consumers: two of them BRPOP queue:cron
        consumers c1 and c2 started
        == ZADD cron:queue <time> <job> becomes a schedule: 13 of them, from T (an even second) for 5 s
        $ head -n 1 schedules.jsonl; tail -n 1 schedules.jsonl
        {"id":"job-01","dest":"jobs","cron":"* * * * * *","payload":"job-01","start_at":<T+0ms>,"end_at":<T+5000ms>,"misfire":"catch_up"}
        {"id":"job-even","dest":"jobs","cron":"*/2 * * * * *","payload":"job-even","start_at":<T+0ms>,"end_at":<T+5000ms>,"misfire":"catch_up"}
        (exit 0)
        $ zdelay schedule set --batch schedules.jsonl | sort
        job-01 <T+0ms>
        job-02 <T+0ms>
        job-03 <T+0ms>
        job-04 <T+0ms>
        job-05 <T+0ms>
        job-06 <T+0ms>
        job-07 <T+0ms>
        job-08 <T+0ms>
        job-09 <T+0ms>
        job-10 <T+0ms>
        job-11 <T+0ms>
        job-12 <T+0ms>
        job-even <T+0ms>
        (exit 0)
        pending occurrences (ZCARD zdelay:{<tag>}:sched_due:jobs, the route's lane): 13, one per schedule; jobs stored ahead of time: 0
        == a worker dies (kill -9) at T+2200ms: the other daemon on each of its shards and lanes carries on
        instance 1 killed with SIGKILL
        zdelay stats: 2 instances, each shard and lane polled by 2 of them
        == each occurrence fired once, by one fenced script, and consumed once
        job-01: consumed 5 times
        job-02: consumed 5 times
        job-03: consumed 5 times
        job-04: consumed 5 times
        job-05: consumed 5 times
        job-06: consumed 5 times
        job-07: consumed 5 times
        job-08: consumed 5 times
        job-09: consumed 5 times
        job-10: consumed 5 times
        job-11: consumed 5 times
        job-12: consumed 5 times
        job-even: consumed 3 times
        consumed 63 = 12 schedules x 5 (T, T+1s, ..., T+4s) + job-even x 3 (T, T+2s, T+4s); queue:cron holds 0
        fired by the three daemons together (zdelay_schedule_occurrences_total): 63
        == no worker runs for a while: what was missed follows each schedule's misfire policy
        the two daemons left stopped (SIGTERM, exit 0); none runs now
        $ zdelay schedule set missed-coalesce --dest jobs --cron '* * * * * *' --start-at <M> --end-at <M+3000ms> --misfire coalesce --payload missed-coalesce
        created missed-coalesce; next occurrence <M+0ms> (<M+0ms>)
        (exit 0)
        $ zdelay schedule set missed-skip --dest jobs --cron '* * * * * *' --start-at <M> --end-at <M+3000ms> --misfire skip --payload missed-skip
        created missed-skip; next occurrence <M+0ms> (<M+0ms>)
        (exit 0)
        $ zdelay schedule set missed-catch_up --dest jobs --cron '* * * * * *' --start-at <M> --end-at <M+3000ms> --misfire catch_up --payload missed-catch_up
        created missed-catch_up; next occurrence <M+0ms> (<M+0ms>)
        (exit 0)
        a daemon starts after M+2000ms, with three occurrences of each schedule missed
        missed-coalesce: delivered 1 of 3
        missed-skip: delivered 0 of 3
        missed-catch_up: delivered 3 of 3
        the daemon fired 4 occurrences
        daemon stopped (SIGTERM, exit 0)
        == one pending occurrence per schedule, nothing planned hours ahead: update, pause, resume, delete
        $ zdelay schedule set standup --dest jobs --cron '0 30 9 * * 1-5' --tz Europe/Paris --start-at 2030-03-29T00:00:00Z --payload standup
        created standup; next occurrence 2030-03-29T09:30:00+01:00 (1901003400000)
        (exit 0)
        $ redis-cli ZRANGE zdelay:{<tag>}:sched_due:jobs 0 -1 WITHSCORES
        standup
        1901003400000
        (exit 0)
        $ zdelay schedule set standup --dest jobs --cron '0 0 10 * * 1-5' --tz Europe/Paris --start-at 2030-03-29T00:00:00Z --payload standup
        updated standup; next occurrence 2030-03-29T10:00:00+01:00 (1901005200000)
        (exit 0)
        $ zdelay schedule pause standup
        paused standup
        (exit 0)
        $ zdelay schedule get standup
        standup  jobs  cron "0 0 10 * * 1-5" Europe/Paris  next none  (paused)
          fired 0, missed 0, expired 0, skipped by calendar 0; never fired
        (exit 0)
        $ zdelay schedule resume standup
        resumed standup; next occurrence 2030-03-29T10:00:00+01:00
        (exit 0)
        $ zdelay schedule delete standup
        deleted standup
        (exit 0)
        $ zdelay schedule get standup
        (exit 3)
        OK
        "##,
    );
}
