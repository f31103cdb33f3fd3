//! The test kit (`warren::testing`) on both databases, with the suite's own
//! handler: what a user's test sees on PostgreSQL is what it sees on SQLite.

use warren::testing::{Settled, TestConsumer};
use warren_admin::DeadLetterReason;

use crate::util::{Backend, Job, Mode, TestBroker, routes, test_config, unique};

on_all_backends!(
    the_kit_settles_every_way_on_a_real_database,
    the_kit_delivers_a_cloudevent_and_a_bare_payload,
);

/// A handler test with messages no `Outgoing` builds: a CloudEvent in each
/// mode and a bare payload, each applied once, a second copy a duplicate.
async fn the_kit_delivers_a_cloudevent_and_a_bare_payload<B: Backend>() {
    use warren::format::{Bare, CloudEvents, Formats, VersionFrom, WarrenEnvelope};
    use warren::lapin::BasicProperties;
    use warren::lapin::types::{AMQPValue, FieldTable};

    let db = B::create().await;
    let formats = Formats::new()
        .then(CloudEvents::new().version_from(VersionFrom::Fixed(1)))
        .then(WarrenEnvelope)
        .then(Bare::new().version_from(VersionFrom::Fixed(1)));
    let kit = TestConsumer::new(
        test_config(&unique("kit"), &unique("kit"), "kit.events")
            .with_formats(formats)
            .build()
            .unwrap(),
        db.store.clone(),
        routes::<B>(),
    )
    .await
    .unwrap();
    let job = serde_json::to_vec(&Job::ok()).unwrap();

    let structured = serde_json::to_vec(&serde_json::json!({
        "specversion": "1.0", "id": "e-1", "source": "/kit", "type": "test.job",
        "data": Job::ok(),
    }))
    .unwrap();
    let structured_props =
        BasicProperties::default().with_content_type("application/cloudevents+json".into());
    let mut headers = FieldTable::default();
    for (k, v) in [
        ("ce-specversion", "1.0"),
        ("ce-id", "e-2"),
        ("ce-source", "/kit"),
        ("ce-type", "test.job"),
    ] {
        headers.insert(k.into(), AMQPValue::LongString(v.into()));
    }
    let binary_props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_headers(headers);
    let bare_props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_message_id("bare-1".into())
        .with_type("test.job".into());

    for (body, props) in [
        (&structured, &structured_props),
        (&job, &binary_props),
        (&job, &bare_props),
    ] {
        assert_eq!(
            kit.deliver_raw(body.clone(), props.clone()).await,
            Settled::Applied
        );
        assert_eq!(
            kit.deliver_raw(body.clone(), props.clone()).await,
            Settled::Duplicate
        );
    }
    // The same id from another source is another event.
    let elsewhere = String::from_utf8(structured.clone())
        .unwrap()
        .replace("/kit", "/other");
    assert_eq!(
        kit.deliver_raw(elsewhere.into_bytes(), structured_props.clone())
            .await,
        Settled::Applied
    );
    assert_eq!(db.effects().await, 4);
    assert_eq!(db.effects_for("bare-1").await, 1);
    drop(kit);
    db.drop_db().await;
}

async fn the_kit_settles_every_way_on_a_real_database<B: Backend>() {
    let db = B::create().await;
    let queue = unique("kit");
    let kit = TestConsumer::new(
        test_config(&unique("kit"), &queue, "kit.events")
            .build()
            .unwrap(),
        db.store.clone(),
        routes::<B>(),
    )
    .await
    .unwrap();

    let applied = TestBroker::message(&Job::ok().emitting(2, "kit.out"));
    assert_eq!(kit.deliver(&applied).await, Settled::Applied);
    assert_eq!(kit.redeliver(&applied).await, Settled::Duplicate);
    let crashed = TestBroker::message(&Job::ok());
    assert_eq!(kit.crash_after_commit(&crashed).await, Settled::Duplicate);

    let flaky = TestBroker::message(&Job::with(Mode::Transient { n: 1 }));
    assert!(matches!(
        kit.deliver(&flaky).await,
        Settled::Retried { attempt: 1, .. }
    ));
    assert_eq!(kit.next_attempt().await, Settled::Applied);

    let refused = TestBroker::message(&Job::with(Mode::Permanent));
    assert!(matches!(
        kit.deliver(&refused).await,
        Settled::DeadLettered {
            reason: DeadLetterReason::Permanent,
            attempts: 1,
            ..
        }
    ));

    assert_eq!(
        db.effects().await,
        3,
        "applied, crashed and flaky, once each"
    );
    let outbox = kit.outbox().await.unwrap();
    assert_eq!(outbox.len(), 2);
    assert!(outbox.iter().all(|m| m.exchange == "kit.out"));
    assert_eq!(kit.dead_letters().len(), 1);
    drop(kit);
    db.drop_db().await;
}

/// A throwaway database whose test was killed stays behind; the next one made
/// on the same server drops it once it is older than `STALE_AFTER`, and
/// leaves a recent one (another test's, running now) alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throwaway_postgres_schemas_left_by_killed_tests_are_dropped_later() {
    use warren::testing::{STALE_AFTER, TestDatabase};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let tail = &unique("t")[2..];
    let old = format!("warren_test_{}_{tail}", now - STALE_AFTER.as_secs() - 60);
    let recent = format!("warren_test_{}_{tail}", now - 60);
    let admin = sqlx::PgPool::connect(&crate::util::pg_admin_url())
        .await
        .unwrap();
    for name in [&old, &recent] {
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&admin)
            .await
            .unwrap();
    }
    let exists = async |name: &str| -> bool {
        sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
            .bind(name)
            .fetch_one(&admin)
            .await
            .map(|n: i64| n == 1)
            .unwrap()
    };

    let db = TestDatabase::postgres(&crate::util::pg_admin_url())
        .await
        .unwrap();
    assert!(!exists(&old).await, "the stale schema was dropped");
    assert!(exists(&recent).await, "a recent one is another test's");
    assert!(exists(db.name()).await);

    // Dropped when the value is, as a test that panics drops it.
    let name = db.name().to_owned();
    drop(db);
    assert!(!exists(&name).await);

    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {recent}")))
        .execute(&admin)
        .await
        .unwrap();
}

/// The same on MySQL and MariaDB, with databases.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throwaway_mysql_databases_left_by_killed_tests_are_dropped_later() {
    use warren::testing::{STALE_AFTER, TestDatabase};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let tail = &unique("t")[2..];
    let old = format!("warren_test_{}_{tail}", now - STALE_AFTER.as_secs() - 60);
    let admin = sqlx::MySqlPool::connect(&crate::util::mysql_admin_url())
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {old}")))
        .execute(&admin)
        .await
        .unwrap();
    let exists = async |name: &str| -> bool {
        sqlx::query_scalar("SELECT count(*) FROM information_schema.schemata WHERE schema_name = ?")
            .bind(name)
            .fetch_one(&admin)
            .await
            .map(|n: i64| n == 1)
            .unwrap()
    };
    let db = TestDatabase::mysql(&crate::util::mysql_admin_url())
        .await
        .unwrap();
    assert!(!exists(&old).await, "the stale database was dropped");
    assert!(exists(db.name()).await);
    let name = db.name().to_owned();
    db.drop_now().await.unwrap();
    assert!(!exists(&name).await);
}
