//! The library in one file: enqueue (relative, absolute, with id and headers, in a batch),
//! look up, reschedule and cancel. Needs a Redis; a running `zdelay run` delivers the jobs.
//!
//! ```text
//! cargo run -p zdelay-client --example enqueue -- redis://127.0.0.1:6379
//! ```

use std::time::{Duration, SystemTime};
use zdelay_client::{Cancelled, Client, Due, NewJob, OnConflict};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    // Namespace "zdelay", as the daemons created it (its shard count is read from Redis).
    // `Client::attach(&config.redis)` takes a `[redis]` section's namespace instead. `with_destinations` makes an unknown route an
    // enqueue error rather than a dead job at delivery.
    let client = Client::open(&url)
        .await?
        .with_destinations(["emails".to_owned(), "default".to_owned()]);

    // Due 250 ms from now by Redis's clock; the id is generated: `~<lane>.<12 characters>` for a
    // local route on storage layout 2 (the default), naming its lane; a ULID for a two-phase
    // route (Kafka, RabbitMQ, NATS, remote Redis) and on layout 1.
    let job = NewJob::new("emails", r#"{"to":"ann@example.com"}"#)
        .after(Duration::from_millis(250))
        .header("trace", "7f3a");
    let (id, outcome) = client.enqueue(job, OnConflict::Replace).await?;
    println!("{id} {outcome:?}");

    // At a moment (a SystemTime, or epoch ms as an i64), with our own id: enqueueing it again
    // is idempotent.
    // The {user-42} hash tag puts every job of this user on one shard, in id order.
    let in_a_minute = SystemTime::now() + Duration::from_secs(60);
    let reminder = NewJob::new("emails", "reminder for user 42")
        .id("{user-42}:reminder")
        .at(in_a_minute);
    client
        .enqueue(reminder.clone(), OnConflict::Replace)
        .await?;
    let (_, again) = client.enqueue(reminder, OnConflict::Keep).await?;
    println!("second enqueue of {{user-42}}:reminder: {again:?}"); // Kept

    // Look it up, move it, cancel it: each O(log N) in its own shard.
    if let Some(view) = client.get("{user-42}:reminder").await? {
        println!("{}", view.to_json());
    }
    let new_due = client
        .reschedule("{user-42}:reminder", Due::In(Duration::from_secs(5)))
        .await?;
    println!("rescheduled to {new_due:?}");
    assert_eq!(
        client.cancel("{user-42}:reminder").await?,
        Cancelled::Cancelled
    );

    // Many at once: one result per job, in input order; a bad job fails alone.
    let jobs = (0..1000)
        .map(|i| NewJob::new("emails", format!("bulk {i}")).after(Duration::from_secs(1)))
        .chain([NewJob::new("no-such-route", "x")])
        .collect();
    let results = client.enqueue_batch(jobs, OnConflict::Replace).await?;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    println!(
        "batch: {} enqueued, failed: {failed:?}",
        results.len() - failed.len()
    );
    Ok(())
}
