//! Encrypted connections, for real: a consumer and its relay over `amqps://` on
//! PostgreSQL with `sslmode=verify-full`, a wrong CA that fails at once naming the
//! host, and client certificates the broker accepts or refuses.
//!
//! They need the throwaway certificates and TLS listeners of `.ci/tls-setup`,
//! found through `WARREN_TLS_DIR`; without it each test prints a note and passes.

#![allow(clippy::print_stderr)] // the skip note, and the errors a user would see

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, Postgres, Sqlite};
use warren::store::Store;
use warren::tls::TlsOptions;
use warren::{Consumer, PgStore, RelayConfig};

use crate::util::*;

fn amqps_url() -> String {
    std::env::var("WARREN_TEST_AMQPS_URL")
        .unwrap_or_else(|_| "amqps://guest:guest@127.0.0.1:5671/%2f".into())
}

fn trusting(dir: &std::path::Path) -> TlsOptions {
    TlsOptions::new().with_ca_file(dir.join("ca.pem"))
}

/// A consumer and its outbox relay over `amqps://`, verifying the broker with the
/// private CA, on PostgreSQL reached with `sslmode=verify-full`: every message is
/// applied once and every outbox event published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_and_relay_over_amqps_on_postgres_verify_full() {
    let Some(dir) = tls_dir() else { return };
    let schema = unique("wtls");
    let admin = sqlx::PgPool::connect(&pg_admin_url()).await.unwrap();
    sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let base = pg_admin_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!(
        "{base}{sep}sslmode=verify-full&sslrootcert={}&options=-c%20search_path%3D{schema}",
        dir.join("ca.pem").display()
    );
    let store = PgStore::connect(&url, 4).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE test_effects (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let encrypted: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert!(encrypted, "the store's connection is not encrypted");

    let broker = TestBroker::new().await;
    let capture = broker.capture().await;
    broker.declare().await;
    let consumer = Consumer::new(
        broker.builder().with_tls(trusting(&dir)).build().unwrap(),
        store.clone(),
        routes::<Postgres>(),
    );
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = RelayConfig::new(format!("{}-relay", broker.name))
        .with_poll_interval(Duration::from_millis(100));
    let run = tokio::spawn(async move {
        consumer
            .run_with_relay(&amqps_url(), relay, async {
                let _ = stopped.await;
            })
            .await
    });
    for _ in 0..5 {
        broker
            .publish(&TestBroker::message(
                &Job::ok().emitting(1, &broker.exchange),
            ))
            .await;
    }
    let applied = wait_for(Duration::from_secs(30), || {
        let s = stats.snapshot();
        async move { s.applied >= 5 }
    })
    .await;
    assert!(applied, "not applied over amqps: {:?}", stats.snapshot());
    // The relay, on the consumer's TLS options, published the outbox events.
    assert!(
        wait_for(Duration::from_secs(30), || async {
            broker.ready(&capture).await >= 5
        })
        .await,
        "outbox events not relayed over amqps"
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM test_effects")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(effects, 5);

    store.pool().close().await;
    broker.cleanup().await;
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// PostgreSQL with `verify-full` and a CA that did not sign the server's
/// certificate refuses to connect.
#[tokio::test]
async fn postgres_verify_full_refuses_an_untrusted_server() {
    let Some(dir) = tls_dir() else { return };
    let base = pg_admin_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!(
        "{base}{sep}sslmode=verify-full&sslrootcert={}",
        dir.join("other-ca.pem").display()
    );
    let started = Instant::now();
    let err = PgStore::connect(&url, 1).await.unwrap_err().to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    eprintln!("untrusted database: {err}");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
}

/// A broker whose certificate no trusted CA signed: the connect fails at once
/// with an error that names the host and says what to set, for the bundled
/// roots alone and for a wrong CA file alike.
#[tokio::test]
async fn an_untrusted_broker_fails_at_once_naming_the_host() {
    let Some(dir) = tls_dir() else { return };
    for tls in [
        TlsOptions::new(),
        TlsOptions::new().with_ca_file(dir.join("other-ca.pem")),
    ] {
        let started = Instant::now();
        let err = warren::broker::connect_with_tls(&amqps_url(), "warren tls test", &tls)
            .await
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "took {:?}",
            started.elapsed()
        );
        assert!(err.is_tls(), "{err:?}");
        let text = err.to_string();
        eprintln!("untrusted broker: {text}");
        assert!(text.contains("127.0.0.1:5671"), "{text}");
        assert!(text.contains("AMQP_CA_FILE"), "{text}");
        assert!(!text.contains("guest:guest"), "credentials leaked: {text}");
    }
}

/// The consumer's reconnect loop treats a certificate failure as fatal: `run`
/// returns the error instead of retrying forever. So does a lone relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_failure_stops_the_consumer_and_the_relay() {
    let Some(dir) = tls_dir() else { return };
    let db = Sqlite::create().await;
    let name = unique("wtls");
    let bad = TlsOptions::new().with_ca_file(dir.join("other-ca.pem"));
    let config = test_config(&name, &format!("{name}.jobs"), &format!("{name}.events"))
        .with_tls(bad.clone())
        .build()
        .unwrap();
    let consumer = Consumer::new(config, db.store.clone(), routes::<Sqlite>());
    let ended = tokio::time::timeout(
        Duration::from_secs(15),
        consumer.run(&amqps_url(), std::future::pending()),
    )
    .await
    .expect("the consumer kept retrying a certificate failure");
    let err = ended.unwrap_err();
    assert!(
        matches!(&err, warren::Error::Broker(b) if b.is_tls()),
        "{err:?}"
    );
    assert!(err.to_string().contains("127.0.0.1:5671"), "{err}");

    let relay = warren::Relay::new(db.store.clone(), RelayConfig::new(&name).with_tls(bad));
    let ended = tokio::time::timeout(
        Duration::from_secs(15),
        relay.run(&amqps_url(), std::future::pending()),
    )
    .await
    .expect("the relay kept retrying a certificate failure");
    assert!(ended.unwrap_err().to_string().contains("127.0.0.1:5671"));
    db.drop_db().await;
}

/// A client certificate signed by the broker's CA is accepted, and the broker
/// sees it; one signed by another CA is refused, with an error naming the host.
#[tokio::test]
async fn client_certificates_are_presented_and_checked() {
    let Some(dir) = tls_dir() else { return };
    let name = unique("warren tls client");
    let tls = trusting(&dir).with_client_cert(dir.join("client.pem"), dir.join("client.key"));
    let connection = Arc::new(
        warren::broker::connect_with_tls(&amqps_url(), &name, &tls)
            .await
            .unwrap(),
    );
    let channel = connection.create_channel().await.unwrap();
    assert!(channel.status().connected());
    // The broker's own view, where its CLI is at hand (the CI machine).
    if let Ok(out) = std::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "list_connections",
            "client_properties",
            "peer_cert_subject",
        ])
        .output()
        && out.status.success()
    {
        let listing = String::from_utf8_lossy(&out.stdout);
        let ours = listing
            .lines()
            .find(|l| l.contains(&name))
            .unwrap_or_else(|| panic!("connection {name} not listed:\n{listing}"));
        assert!(ours.contains("CN=warren-test-client"), "{ours}");
    }
    let _ = connection.close(200, "ok".into()).await;

    let untrusted =
        trusting(&dir).with_client_cert(dir.join("other-client.pem"), dir.join("other-client.key"));
    let started = Instant::now();
    let err = warren::broker::connect_with_tls(&amqps_url(), "warren tls test", &untrusted)
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(err.is_tls(), "{err:?}");
    let text = err.to_string();
    eprintln!("untrusted client: {text}");
    assert!(text.contains("127.0.0.1:5671"), "{text}");
    assert!(text.contains("client certificate"), "{text}");
}

/// Mistakes that would otherwise run unencrypted or hang: `amqps://` to the
/// plain port, TLS options with an `amqp://` URL, a missing CA file.
#[tokio::test]
async fn tls_mistakes_are_named() {
    let Some(dir) = tls_dir() else { return };
    let plain_port = amqps_url().replace(":5671", ":5672");
    let started = Instant::now();
    let err = warren::broker::connect_with_tls(&plain_port, "warren tls test", &trusting(&dir))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(err.is_tls(), "{err:?}");
    eprintln!("plain port: {err}");
    assert!(err.to_string().contains("TLS port"), "{err}");

    let err = warren::broker::connect_with_tls(&amqp_url(), "warren tls test", &trusting(&dir))
        .await
        .unwrap_err();
    assert!(
        err.is_tls() && err.to_string().contains("not an amqps:// URL"),
        "{err}"
    );

    let missing = TlsOptions::new().with_ca_file(dir.join("no-such-ca.pem"));
    let err = warren::broker::connect_with_tls(&amqps_url(), "warren tls test", &missing)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no-such-ca.pem"), "{err}");
}

/// `warren doctor` reads a management API served over HTTPS, trusting the
/// AMQP connection's private CA; with only the public roots it is refused, the
/// reason named. The API here is a stand-in serving one overview: the shared
/// broker's management listener stays plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_reads_a_management_api_over_https_with_the_private_ca() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use warren_doctor::{BrokerAccess, Management};

    let Some(dir) = tls_dir() else { return };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("server.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut request = vec![0u8; 4096];
                let n = tls.read(&mut request).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&request[..n]).to_lowercase();
                let body = if request.starts_with("get /api/overview ")
                    && request.contains("authorization: basic ")
                {
                    r#"{"rabbitmq_version":"3.10.8","node":"rabbit@tls","exchange_types":[]}"#
                } else {
                    "[]"
                };
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(answer.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    let access = |tls: TlsOptions| BrokerAccess {
        amqp_url: "amqps://guest:guest@localhost:5671/%2f".into(),
        tls,
        management_url: Some(format!("https://localhost:{port}/")),
        rabbitmqctl: None,
    };
    let trusted = Management::new(&access(trusting(&dir))).unwrap();
    let facts = trusted.ask(&[]).await.unwrap();
    assert_eq!(facts.version_text, "3.10.8");
    assert_eq!(facts.node, "rabbit@tls");

    let untrusting = Management::new(&access(TlsOptions::new())).unwrap();
    let refused = untrusting.ask(&[]).await.unwrap_err();
    assert!(
        refused.contains("TLS") && refused.contains("localhost"),
        "{refused}"
    );
    server.abort();
}
