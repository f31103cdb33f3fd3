//! The trace chain across three processes: this test publishes an invoice as
//! the producer (its span the trace's root), `billing run` fails it twice
//! (each time through a retry tier), then applies it and writes its event to
//! the outbox, and `billing downstream`, another process
//! with a database of its own, applies the event. billing's relay is refused
//! the publish (its broker user may not write to the exchange) and billing
//! is stopped with the row committed and unpublished; a second `billing run`
//! publishes it, knowing nothing but the context stored with the row. Both
//! processes export their spans over OTLP/HTTP (JSON) to a receiver this test
//! runs, and the chain is read off the spans: producer, consumer, handler,
//! outbox wait, relay publish, downstream consumer, each the parent of the
//! next, with each retry's delivery the child of the retry publish before it.

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{PgSchema, billing, free_port, start_run, unique, wait_for};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use warren::Outgoing;
use warren::lapin::options::QueueDeclareOptions;
use warren::lapin::types::FieldTable;

/// Spans received, as OTLP JSON objects, each with its service's name.
type Received = Arc<Mutex<Vec<(String, Value)>>>;

/// A small OTLP/HTTP receiver: answers every POST with `{}` and keeps the
/// spans of the bodies sent to /v1/traces.
async fn receiver() -> (u16, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let spans: Received = Arc::default();
    let kept = Arc::clone(&spans);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                // Keep-alive: requests one after another on one connection.
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    let mut first = true;
                    loop {
                        line.clear();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if first {
                            first = false;
                            continue;
                        }
                        let header = line.trim_end();
                        if header.is_empty() {
                            break;
                        }
                        if let Some((name, value)) = header.split_once(':')
                            && name.eq_ignore_ascii_case("content-length")
                        {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    if let Ok(request) = serde_json::from_slice::<Value>(&body) {
                        keep(&kept, &request);
                    }
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    if stream.get_mut().write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, spans)
}

fn keep(kept: &Received, request: &Value) {
    for resource in request["resourceSpans"].as_array().into_iter().flatten() {
        let service = resource["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .and_then(|a| a["value"]["stringValue"].as_str())
            .unwrap_or("")
            .to_owned();
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            for span in scope["spans"].as_array().into_iter().flatten() {
                kept.lock().unwrap().push((service.clone(), span.clone()));
            }
        }
    }
}

fn attribute<'v>(span: &'v Value, key: &str) -> Option<&'v str> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?["value"]["stringValue"]
        .as_str()
}

/// The spans of `service` named `name` whose parent is `parent`.
fn children<'s>(
    spans: &'s [(String, Value)],
    service: &str,
    name: &str,
    parent: &Value,
) -> Vec<&'s Value> {
    spans
        .iter()
        .filter(|(s, v)| s == service && v["name"] == name && v["parentSpanId"] == parent["spanId"])
        .map(|(_, v)| v)
        .collect()
}

/// The span of `service` named `name` whose parent is `parent`.
fn child<'s>(
    spans: &'s [(String, Value)],
    service: &str,
    name: &str,
    parent: &str,
) -> Option<&'s Value> {
    spans
        .iter()
        .find(|(s, v)| s == service && v["name"] == name && v["parentSpanId"] == parent)
        .map(|(_, v)| v)
}

fn rabbitmqctl(args: &[&str]) {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn consumers(connection: &warren::lapin::Connection, queue: &str) -> u32 {
    let channel = connection.create_channel().await.unwrap();
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = channel.close(200, "ok".into()).await;
    declared.map_or(0, |q| q.consumer_count())
}

async fn stop(mut child: tokio::process::Child) {
    let pid = child.id().expect("running") as i32;
    // SIGTERM: a graceful stop, which exports the spans still buffered.
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("stopped within 60 s")
        .unwrap();
    assert!(status.success(), "stopped cleanly: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_runs_from_producer_through_the_outbox_to_the_downstream_consumer() {
    let (otlp_port, spans) = receiver().await;
    let prefix = unique("trace");
    let billing_db = PgSchema::create("trace_billing").await;
    let downstream_db = PgSchema::create("trace_downstream").await;
    // billing's own broker user, which may do anything but publish to
    // P.events: its relay is refused until billing runs as guest again.
    let user = unique("billing-user");
    rabbitmqctl(&["add_user", &user, "secret"]);
    let exchange = format!("{prefix}.events");
    let no_events = format!("^(?!{}$).*", exchange.replace('.', "\\."));
    rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", &no_events, ".*"]);
    let restricted_url = format!("amqp://{user}:secret@127.0.0.1:5672/%2f");
    let otel = |cmd: &mut tokio::process::Command, service: &str| {
        cmd.env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{otlp_port}"),
        )
        .env("OTEL_SERVICE_NAME", service)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    };

    let mut first = billing();
    let tiers = ["--retry-tiers", "100ms,200ms,300ms"];
    first.args(["--database-url", &billing_db.url, "--prefix", &prefix]);
    first.args(tiers);
    first.env("AMQP_URL", &restricted_url);
    otel(&mut first, "billing");
    let billing_run = start_run(&mut first, free_port()).await;

    let mut downstream_cmd = billing();
    downstream_cmd.args([
        "--database-url",
        &downstream_db.url,
        "--prefix",
        &prefix,
        "downstream",
    ]);
    otel(&mut downstream_cmd, "downstream");
    let log = tempfile::NamedTempFile::new().unwrap();
    let downstream = downstream_cmd
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let connection = common::warren_connect().await;
    let downstream_queue = format!("{prefix}.downstream");
    assert!(
        wait_for(Duration::from_secs(60), || async {
            consumers(&connection, &downstream_queue).await == 1
        })
        .await,
        "billing downstream never subscribed: {}",
        std::fs::read_to_string(log.path()).unwrap_or_default()
    );

    // The producer: this test, whose span is the root.
    let trace_id = format!("{:032x}", fastrand::u128(1..));
    let producer_span = &format!("{:016x}", fastrand::u64(1..));
    // A flaky customer: billing fails its first two attempts, so the message
    // comes back through a retry tier twice before it is applied.
    let customer = unique("cus_flaky");
    let invoice = Outgoing::new(
        "billing.invoice-paid.v1",
        1,
        &serde_json::json!({
            "invoiceId": unique("inv"),
            "customerId": customer,
            "amount": 12.5,
            "currency": "EUR",
        }),
    )
    .unwrap()
    .with_header("traceparent", format!("00-{trace_id}-{producer_span}-01"))
    .with_header("baggage", "tenant=acme");
    let publisher = warren::broker::Publisher::new(Arc::new(connection));
    publisher
        .publish(&exchange, "billing.invoice-paid.v1", &invoice)
        .await
        .unwrap();

    // Applied, its event committed to the outbox, and refused at publish.
    let pool = sqlx::PgPool::connect(&billing_db.url).await.unwrap();
    let row = "SELECT traceparent, attempts FROM warren_outbox WHERE published_at IS NULL";
    assert!(
        wait_for(Duration::from_secs(60), || async {
            let got: Option<(Option<String>, i64)> =
                sqlx::query_as(row).fetch_optional(&pool).await.unwrap();
            got.is_some_and(|(_, attempts)| attempts >= 1)
        })
        .await,
        "the event was never committed and refused: outbox {:?}, journal {:?}",
        sqlx::query_as::<_, (Option<String>, i64, Option<String>)>(
            "SELECT traceparent, attempts, last_error FROM warren_outbox"
        )
        .fetch_all(&pool)
        .await
        .unwrap(),
        sqlx::query_as::<_, (String, String)>("SELECT outcome, detail FROM warren_journal")
            .fetch_all(&pool)
            .await
            .unwrap()
    );
    let (stored, _): (Option<String>, i64) = sqlx::query_as(row).fetch_one(&pool).await.unwrap();
    let stored = stored.expect("the row keeps the handler's context");
    assert!(stored.contains(&trace_id), "{stored}");
    stop(billing_run).await;

    // A new process, allowed to publish: its relay has only the row.
    let mut second = billing();
    second.args(["--database-url", &billing_db.url, "--prefix", &prefix]);
    second.args(tiers);
    otel(&mut second, "billing");
    let billing_again = start_run(&mut second, free_port()).await;
    let downstream_pool = sqlx::PgPool::connect(&downstream_db.url).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(60), || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM warren_inbox WHERE consumer_name = 'billing-downstream'",
            )
            .fetch_one(&downstream_pool)
            .await
            .unwrap()
                == 1
        })
        .await,
        "the event never reached the downstream consumer"
    );
    stop(billing_again).await;
    stop(downstream).await;

    // The chain, parent to child, read off what the three processes sent.
    let queue = format!("{prefix}.invoice-paid");
    let chain = || {
        let spans = spans.lock().unwrap().clone();
        let ours: Vec<(String, Value)> = spans
            .into_iter()
            .filter(|(_, s)| s["traceId"] == trace_id.as_str())
            .collect();
        // Each attempt's delivery is the child of the retry publish of the
        // attempt before it; the first is the producer's child.
        let process = format!("process {queue}");
        let first = child(&ours, "billing", &process, producer_span)?;
        let mut consumer = first;
        let mut retries = 0;
        let handler = loop {
            let id = consumer["spanId"].as_str()?;
            if let Some(h) = child(&ours, "billing", "handle billing.invoice-paid.v1", id)
                && child(&ours, "billing", "ack", id).is_some()
            {
                break h;
            }
            let retry = child(&ours, "billing", "retry publish", id)?;
            consumer = child(&ours, "billing", &process, retry["spanId"].as_str()?)?;
            retries += 1;
        };
        // Each refused pass left an outbox wait and a publish of its own;
        // the chain runs through the pass that published.
        let (outbox, publish, downstream) = children(&ours, "billing", "outbox wait", handler)
            .into_iter()
            .flat_map(|outbox| {
                children(&ours, "billing", &format!("publish {exchange}"), outbox)
                    .into_iter()
                    .map(move |publish| (outbox, publish))
            })
            .find_map(|(outbox, publish)| {
                let name = format!("process {downstream_queue}");
                let downstream = children(&ours, "downstream", &name, publish);
                downstream.first().map(|d| (outbox, publish, *d))
            })?;
        Some((
            ours.clone(),
            retries,
            [first, consumer, handler, outbox, publish, downstream].map(Clone::clone),
        ))
    };
    assert!(
        wait_for(Duration::from_secs(20), || async { chain().is_some() }).await,
        "no complete chain among the spans received: {:#?}",
        spans
            .lock()
            .unwrap()
            .iter()
            .map(|(s, v)| format!(
                "{s} {} {} parent {}",
                v["name"], v["spanId"], v["parentSpanId"]
            ))
            .collect::<Vec<_>>()
    );
    let (ours, retries, [first, consumer, _handler, outbox, _publish, downstream_span]) =
        chain().unwrap();
    assert_eq!(
        retries, 2,
        "two attempts failed, each one hop through a tier"
    );
    for process in [&first, &consumer, &downstream_span] {
        assert_eq!(attribute(process, "messaging.system"), Some("rabbitmq"));
        assert!(attribute(process, "messaging.message.id").is_some());
        assert!(attribute(process, "messaging.destination.name").is_some());
    }
    assert_eq!(
        attribute(&consumer, "messaging.message.id"),
        Some(invoice.meta().message_id.as_str())
    );
    // The outbox wait began when the row was written, before the first
    // billing stopped, so it spans the restart.
    let started = |s: &Value| {
        s["startTimeUnixNano"]
            .as_str()
            .and_then(|t| t.parse::<u128>().ok())
    };
    let ended = |s: &Value| {
        s["endTimeUnixNano"]
            .as_str()
            .and_then(|t| t.parse::<u128>().ok())
    };
    assert!(started(&outbox) < ended(&consumer), "{outbox:#}");
    // No payload field in any span.
    let text = serde_json::to_string(&ours).unwrap();
    assert!(
        !text.contains(&customer),
        "a payload field went into a span"
    );

    rabbitmqctl(&["delete_user", &user]);
    let connection = common::warren_connect().await;
    common::delete_prefix(&connection, &prefix).await;
    pool.close().await;
    downstream_pool.close().await;
    billing_db.remove().await;
    downstream_db.remove().await;
}
