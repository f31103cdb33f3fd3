//! The kit against itself: each way a delivery settles, and each replay of
//! at-least-once delivery, on an in-memory SQLite database.

use serde::{Deserialize, Serialize};
use sqlx::Sqlite;

use super::*;
use crate::retry::RetryPolicy;
use crate::store::Tx;
use crate::store::sqlite::SqliteStore;
use crate::{HandlerError, Message};

const EVENT: &str = "test.job.v1";
const MS: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Job {
    /// Fail transiently while the attempt is at most this.
    fail_until: u32,
    permanent: bool,
}

async fn job(msg: Message<Job>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (message_id, attempt) VALUES (?, ?)")
        .bind(&msg.meta.message_id)
        .bind(i64::from(msg.attempt))
        .execute(tx.conn())
        .await?;
    if msg.payload.permanent {
        return Err(HandlerError::permanent("never"));
    }
    if msg.attempt <= msg.payload.fail_until {
        return Err(HandlerError::transient(format!("attempt {}", msg.attempt)));
    }
    let done = Outgoing::new("test.done.v1", 1, &serde_json::json!({ "n": 1 }))
        .map_err(HandlerError::permanent)?
        .caused_by(&msg.meta);
    tx.publish("out", "test.done.v1", done).await?;
    Ok(())
}

async fn kit() -> TestConsumer<SqliteStore> {
    let store = sqlite_in_memory().await.unwrap();
    sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL, attempt INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let config = ConsumerConfig::builder("c", "q")
        .with_retry(
            RetryPolicy::new([100 * MS, 200 * MS])
                .with_max_attempts(3)
                .with_poison_limit(3),
        )
        .build()
        .unwrap();
    TestConsumer::new(config, store, Registry::new().route(EVENT, 1, job))
        .await
        .unwrap()
}

fn message(job: &Job) -> Outgoing {
    Outgoing::new(EVENT, 1, job).unwrap()
}

async fn effects(kit: &TestConsumer<SqliteStore>) -> Vec<i64> {
    sqlx::query_scalar("SELECT attempt FROM effects ORDER BY attempt")
        .fetch_all(kit.store().pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn testing_applies_and_lists_the_outbox() {
    let kit = kit().await;
    let m = message(&Job::default());
    assert_eq!(kit.deliver(&m).await, Settled::Applied);
    assert_eq!(effects(&kit).await, [1]);
    let outbox = kit.outbox().await.unwrap();
    assert_eq!(outbox.len(), 1);
    assert_eq!(
        (outbox[0].exchange.as_str(), outbox[0].routing_key.as_str()),
        ("out", "test.done.v1")
    );
    assert_eq!(
        outbox[0].meta.causation_id.as_deref(),
        Some(m.meta().message_id.as_str())
    );
    assert_eq!(outbox[0].payload::<serde_json::Value>().unwrap()["n"], 1);
    assert_eq!(
        kit.outbox().await.unwrap().len(),
        1,
        "listed again, not taken twice"
    );
}

#[tokio::test]
async fn testing_redeliveries_and_crashes_are_duplicates() {
    let kit = kit().await;
    let m = message(&Job::default());
    assert_eq!(kit.crash_after_commit(&m).await, Settled::Duplicate);
    assert_eq!(kit.redeliver(&m).await, Settled::Duplicate);
    assert_eq!(kit.deliver(&m).await, Settled::Duplicate);
    assert_eq!(effects(&kit).await, [1]);
    assert_eq!(kit.outbox().await.unwrap().len(), 1);
    let s = kit.stats();
    assert_eq!((s.applied, s.duplicates), (1, 3));
}

#[tokio::test]
async fn testing_retries_climb_the_tiers_then_apply() {
    let kit = kit().await;
    let m = message(&Job {
        fail_until: 2,
        ..Job::default()
    });
    assert_eq!(
        kit.deliver(&m).await,
        Settled::Retried {
            attempt: 1,
            delay: 100 * MS,
            error: "attempt 1".into()
        }
    );
    assert!(matches!(
        kit.next_attempt().await,
        Settled::Retried { attempt: 2, delay, .. } if delay == 200 * MS
    ));
    assert_eq!(kit.next_attempt().await, Settled::Applied);
    assert_eq!(effects(&kit).await, [3], "failed attempts rolled back");
}

#[tokio::test]
async fn testing_attempt_n_is_signed_and_believed() {
    let kit = kit().await;
    let m = message(&Job {
        fail_until: 10,
        ..Job::default()
    });
    assert_eq!(
        kit.deliver_attempt(&m, 3).await,
        Settled::DeadLettered {
            reason: DeadLetterReason::RetriesExhausted,
            error: "attempt 3".into(),
            attempts: 3
        }
    );
    let ok = message(&Job {
        fail_until: 1,
        ..Job::default()
    });
    assert_eq!(kit.deliver_attempt(&ok, 2).await, Settled::Applied);
    assert_eq!(kit.dead_letters().len(), 1);
    assert_eq!(kit.dead_letters()[0].consumer, "c");
}

#[tokio::test]
async fn testing_permanent_failures_and_garbage_are_dead_lettered() {
    let kit = kit().await;
    let m = message(&Job {
        permanent: true,
        ..Job::default()
    });
    assert!(matches!(
        kit.deliver(&m).await,
        Settled::DeadLettered {
            reason: DeadLetterReason::Permanent,
            attempts: 1,
            ..
        }
    ));
    let garbage = BasicProperties::default()
        .with_message_id("m".into())
        .with_content_type("application/json".into());
    assert!(matches!(
        kit.deliver_raw("not json", garbage).await,
        Settled::DeadLettered {
            reason: DeadLetterReason::InvalidJson,
            ..
        }
    ));
    assert!(matches!(
        kit.deliver_json("test.unknown.v1", 1, &serde_json::json!({}))
            .await,
        Settled::DeadLettered {
            reason: DeadLetterReason::UnknownEventType,
            ..
        }
    ));
    assert_eq!(kit.dead_letters().len(), 3);
    assert!(effects(&kit).await.is_empty());
    assert!(kit.outbox().await.unwrap().is_empty());
}

#[tokio::test]
async fn testing_a_database_outage_returns_the_message() {
    let kit = kit().await;
    kit.store().pool().close().await;
    assert_eq!(
        kit.deliver(&message(&Job::default())).await,
        Settled::Returned
    );
}
