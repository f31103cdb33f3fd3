//! The dead-letter store at 100 000 letters on PostgreSQL: how long `groups`
//! and the first page of `list` take for each filter, and a careful replay of
//! all of them interrupted halfway, resumed, each letter replayed once.
//! It runs among the other tests, first in CI's profile (its three minutes
//! overlap the rest), or alone by hand: `cargo nextest run --all-features
//! --no-capture -E 'test(dead_letter_scale)'`. It prints the timings it
//! measured, recorded in docs/performance.md from a run alone; it asserts no
//! time, only what must hold.

use std::sync::Arc;
use std::time::{Duration, Instant};

use warren::store::{Actor, DeadLetterStore, LetterFilter, LetterState};
use warren::{Consumer, ConsumerConfig};
use warren_admin::Replayer;

use crate::util::{Backend, Job, Running, TestBroker, routes, wait_for};

const LETTERS: i64 = 100_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stdout)] // the timings are what it is for
async fn a_hundred_thousand_letters_are_found_fast_and_replayed_once_through_an_interruption() {
    type B = sqlx::Postgres;
    let db = <B as Backend>::create().await;
    let broker = TestBroker::new().await;
    let config: ConsumerConfig = broker.config();
    broker.declare_config(&config).await;

    // 100 000 letters in one statement: 20 groups, 5 event types, 1 000
    // customers, spread over 10 days. Each is a valid message of the test
    // consumer, so that the replay applies it.
    let template = TestBroker::message(&Job::ok());
    let template_id = template.meta().message_id.clone();
    let body = String::from_utf8(template.body()).unwrap();
    let properties = serde_json::to_string(&template.properties()).unwrap();
    let started = Instant::now();
    sqlx::query(
        "INSERT INTO warren_dead_letters (letter_id, consumer_name, queue_name, message_id,
             event_type, correlation_id, replay_id, reason, error, attempts, original_exchange,
             original_routing_key, first_failure, last_failure, fingerprint, group_key, headers,
             properties, body, body_truncated, payload, redacted_fields, entity, entity_version,
             state)
         SELECT md5(g::text), $1, $2, 'scale-' || g, 'test.type' || (g % 5), 'corr-' || g, '',
                CASE WHEN g % 3 = 0 THEN 'retries-exhausted' ELSE 'permanent-failure' END,
                'customer cus_' || (g % 1000) || ' not found', 1, $3, 'test.job',
                now() - (g || ' seconds')::interval * 8.64,
                now() - (g || ' seconds')::interval * 8.64,
                'group' || (g % 20), 'group' || (g % 20), '{}',
                replace($4, $5, 'scale-' || g),
                convert_to(replace($6, $5, 'scale-' || g), 'UTF8'), false,
                jsonb_build_object('customerId', 'cus_' || (g % 1000), 'mode',
                                   jsonb_build_object('kind', 'ok')),
                '', '', NULL, 'unresolved'
         FROM generate_series(1, $7) g",
    )
    .bind(config.name())
    .bind(config.queue())
    .bind(&broker.exchange)
    .bind(&properties)
    .bind(&template_id)
    .bind(&body)
    .bind(LETTERS)
    .execute(<B as Backend>::pool(&db.store))
    .await
    .unwrap();
    sqlx::query("ANALYZE warren_dead_letters")
        .execute(<B as Backend>::pool(&db.store))
        .await
        .unwrap();
    println!("inserted {LETTERS} letters in {:?}", started.elapsed());

    let timed = Instant::now();
    let groups = db
        .store
        .dead_letter_groups(&LetterFilter::default(), 50)
        .await
        .unwrap();
    println!("groups: {} groups in {:?}", groups.len(), timed.elapsed());
    assert_eq!(groups.len(), 20);
    assert_eq!(groups.iter().map(|g| g.count).sum::<u64>(), LETTERS as u64);

    let day = chrono::Duration::days(1);
    let now = chrono::Utc::now();
    let filters: Vec<(&str, LetterFilter)> = vec![
        ("none", LetterFilter::default()),
        (
            "type",
            LetterFilter {
                event_type: Some("test.type3".into()),
                ..Default::default()
            },
        ),
        (
            "reason",
            LetterFilter {
                reason: Some("retries-exhausted".into()),
                ..Default::default()
            },
        ),
        (
            "group",
            LetterFilter {
                group: Some("group7".into()),
                ..Default::default()
            },
        ),
        (
            "date range",
            LetterFilter {
                since: Some(now - day * 6),
                until: Some(now - day * 5),
                ..Default::default()
            },
        ),
        (
            "message id",
            LetterFilter {
                message_id: Some("scale-77777".into()),
                ..Default::default()
            },
        ),
        (
            "correlation id",
            LetterFilter {
                correlation_id: Some("corr-4242".into()),
                ..Default::default()
            },
        ),
        (
            "payload field",
            LetterFilter {
                payload_field: Some(("customerId".into(), "cus_321".into())),
                ..Default::default()
            },
        ),
    ];
    for (name, filter) in &filters {
        let timed = Instant::now();
        let page = db.store.dead_letters(filter, None, 50).await.unwrap();
        println!(
            "list first page, filter {name}: {} letters in {:?}",
            page.len(),
            timed.elapsed()
        );
        assert!(!page.is_empty(), "{name}");
    }

    // The console's pages over HTTP, rendered whole: the groups page and the
    // first page of a search (the goal: under 300 ms each).
    let console = warren_console::Console::bind(warren_console::ConsoleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
    ))
    .await
    .unwrap();
    let addr = console.local_addr().unwrap();
    let (stop_console, console_stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(console.serve(db.store.clone(), async {
        let _ = console_stopped.await;
    }));
    for path in [
        "/",
        "/letters",
        "/letters?group=group7",
        "/letters?field=customerId&value=cus_321",
        "/letters?since=2020-01-01&until=2100-01-01&event_type=test.type3",
    ] {
        // Twice: the first request of a path also warms the connection pool.
        for round in ["cold", "warm"] {
            let timed = Instant::now();
            let page = http_get(addr, path).await;
            let took = timed.elapsed();
            assert!(page.starts_with("HTTP/1.1 200"), "{path}: {page}");
            println!("console {path} ({round}): {} bytes in {took:?}", page.len());
        }
    }
    let _ = stop_console.send(());
    serving.await.unwrap().unwrap();

    // A careful replay of all of them, interrupted halfway and resumed.
    let running = Running::start(Consumer::new(
        config.clone(),
        db.store.clone(),
        routes::<B>(),
    ));
    let replayer = Arc::new(
        Replayer::new(
            db.store.clone(),
            Arc::clone(&broker.connection),
            Actor::new("scale"),
        )
        .careful(Duration::from_secs(60)),
    );
    let timed = Instant::now();
    let run = replayer
        .start(&LetterFilter::default(), None, false)
        .await
        .unwrap();
    println!(
        "replay run of {} letters recorded in {:?}",
        run.total,
        timed.elapsed()
    );
    let (half, mut halfway) = tokio::sync::mpsc::unbounded_channel();
    let interrupted = {
        let replayer = Arc::clone(&replayer);
        let run_id = run.run_id.clone();
        tokio::spawn(async move {
            let _ = replayer
                .resume(&run_id, move |p| {
                    let _ = half.send(p.seq);
                })
                .await;
        })
    };
    while let Some(seq) = halfway.recv().await {
        if seq >= (LETTERS / 2) as u64 {
            break;
        }
    }
    interrupted.abort();
    let _ = interrupted.await;
    let midway = db.store.replay_run(&run.run_id).await.unwrap().unwrap();
    println!(
        "interrupted after {} published, {:?}",
        midway.published,
        timed.elapsed()
    );
    assert!(midway.published < LETTERS as u64);
    let done = replayer.resume(&run.run_id, |_| {}).await.unwrap();
    println!(
        "replayed {} letters in {:?}",
        done.published,
        timed.elapsed()
    );
    assert_eq!(
        (done.published, done.state.as_str()),
        (LETTERS as u64, "finished")
    );
    assert!(
        wait_for(Duration::from_secs(600), || async {
            db.effects().await >= LETTERS
        })
        .await,
        "every replayed letter applied"
    );
    running.stop().await.unwrap();
    assert_eq!(db.distinct_effects().await, LETTERS, "each applied once");
    assert_eq!(db.effects().await, LETTERS, "none applied twice");
    let replayed = LetterFilter {
        state: LetterState::Replayed,
        ..Default::default()
    };
    let groups = db.store.dead_letter_groups(&replayed, 50).await.unwrap();
    assert_eq!(groups.iter().map(|g| g.count).sum::<u64>(), LETTERS as u64);
    let twice = <B as Backend>::count(
        &db.store,
        "SELECT count(*) FROM warren_dead_letters WHERE replay_count <> 1".into(),
    )
    .await;
    assert_eq!(twice, 0, "each letter replayed once");

    broker.cleanup().await;
    db.drop_db().await;
}

/// One GET, read to the end of the answer.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}
