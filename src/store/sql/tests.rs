//! The shared implementation on a throwaway SQLite file: no server needed.

use super::*;
use crate::outbox_row::RowOutcome;
use crate::outgoing::Outgoing;
use crate::store::OutboxStore;
use crate::store::sqlite::SqliteStore;

async fn store(dir: &tempfile::TempDir) -> SqliteStore {
    let path = dir.path().join("warren.db");
    let store = SqliteStore::connect(path.to_str().unwrap()).await.unwrap();
    store.migrate().await.unwrap();
    store
}

#[tokio::test]
async fn migrating_again_runs_nothing_twice_and_records_every_version() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    store.migrate().await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM warren_migrations ORDER BY version")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
}

#[tokio::test]
async fn a_message_id_is_claimed_once_and_redeliveries_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let entry = InboxEntry {
        consumer_name: "c",
        message_id: "m-1",
        event_type: "t",
        correlation_id: None,
        received_at: Utc::now(),
    };
    for expected in [true, false] {
        let mut tx = store.begin().await.unwrap();
        assert_eq!(store.claim(&mut tx, &entry).await.unwrap(), expected);
        tx.commit().await.unwrap();
    }
    assert_eq!(store.record_solo_run("c", "m-1").await.unwrap(), 1);
    assert_eq!(store.record_solo_run("c", "m-1").await.unwrap(), 2);
    store.clear_solo_runs(None, "c", "m-1").await.unwrap();
    assert_eq!(store.record_solo_run("c", "m-1").await.unwrap(), 1);
    let later = Utc::now() + chrono::Duration::seconds(1);
    assert_eq!(store.purge_inbox("c", later, 10).await.unwrap(), 1);
    assert_eq!(
        store.signing_key().await.unwrap(),
        store.signing_key().await.unwrap()
    );
}

#[tokio::test]
async fn outbox_rows_go_out_in_order_and_their_outcomes_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let mut tx = store.begin().await.unwrap();
    for n in 0..3 {
        let message = Outgoing::new("t", 1, &serde_json::json!({ "n": n })).unwrap();
        tx.publish("ex", "key", message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let taken = store
        .relay_batch(10, |rows| async move {
            let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            assert!(ids.is_sorted(), "{ids:?}");
            vec![
                (ids[0], RowOutcome::Published),
                (ids[1], RowOutcome::Failed("no route".into())),
                (ids[2], RowOutcome::Retry("nacked".into())),
            ]
        })
        .await
        .unwrap();
    assert_eq!(taken, 3);
    let counts = store.outbox_counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.failed), (1, 1, 1));
    assert!(counts.oldest_pending.is_some());
    let (pending, oldest) = store.outbox_backlog().await.unwrap();
    assert_eq!((pending, oldest), (counts.pending, counts.oldest_pending));
    let failed = store.failed_outbox_rows(10).await.unwrap();
    assert_eq!(failed[0].last_error, "no route");
    assert_eq!(store.retry_failed(&[failed[0].id]).await.unwrap(), 1);
    let later = Utc::now() + chrono::Duration::seconds(1);
    assert_eq!(store.delete_published_before(later, 10).await.unwrap(), 1);
}
