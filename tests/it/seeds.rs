//! The worked examples (`examples/seeds/<name>/run.sh`, README "Worked examples"): each
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

/// Compares a transcript with the expected lines (leading and trailing blanks of `expected`
/// ignored), naming the first line that differs.
fn assert_transcript(name: &str, got: &[String], expected: &str) {
    let want: Vec<&str> = expected.trim().lines().map(str::trim_start).collect();
    let first_diff = (0..got.len().max(want.len()))
        .find(|&i| got.get(i).map(String::as_str) != want.get(i).copied());
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
        (exit 1)
        == remove(object) after it expired: nothing left to remove
        $ redis-cli ZREM scheduled_objects obj-a
        0
        (exit 0)
        $ zdelay cancel obj-c
        obj-c is not pending (delivered, dead or unknown)
        (exit 1)
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
