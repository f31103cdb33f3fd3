//! The rules on responses recorded from each version's documented
//! behaviour (`recorded/`: 3.10.8 live from this project's CI broker, the
//! others written from release notes, each file saying which).

use std::time::Duration;

use serde_json::Value;

use super::*;
use warren::ConsumerConfig;
use warren::retry::RetryPolicy;

fn recorded(version: &str) -> ApiFacts {
    let text = match version {
        "3.10.8" => include_str!("recorded/3.10.8.json"),
        "3.13.7" => include_str!("recorded/3.13.7.json"),
        "4.0.1" => include_str!("recorded/4.0.1.json"),
        "4.3.0" => include_str!("recorded/4.3.0.json"),
        other => panic!("no recording of {other}"),
    };
    let r: Value = serde_json::from_str(text).unwrap();
    let mut api = ApiFacts::read(&r["overview"], Some(&r["feature_flags"])).unwrap();
    let list = |k: &str| r[k].as_array().cloned();
    let (policies, operator) = (list("policies"), list("operator_policies"));
    for (name, q) in r["queues"].as_object().unwrap() {
        let facts = QueueFacts::read_listed(q, policies.as_deref(), operator.as_deref());
        api.queues.insert(name.clone(), Some(facts.unwrap()));
    }
    api
}

/// The consumer the recordings were made for (at the prefetch of the time,
/// which its queues' delivery limit follows).
fn consumer() -> ConsumerConfig {
    ConsumerConfig::builder("rec", "rec.orders")
        .with_prefetch(32)
        .with_retry(RetryPolicy::new([
            Duration::from_secs(5),
            Duration::from_secs(30),
        ]))
        .build()
        .unwrap()
}

fn node(timeout_ms: Option<u64>, max_message_size: Option<u64>) -> NodeSettings {
    NodeSettings {
        node: "rabbit@localhost".into(),
        consumer_timeout_ms: timeout_ms,
        max_message_size,
        frame_max: Some(131_072),
        dead_letter_resend_ms: Some(15_000),
    }
}

fn facts(version: &str) -> BrokerFacts {
    BrokerFacts {
        api: Some(recorded(version)),
        node: Some(node(Some(1_800_000), None)),
        connection: Some(ConnectionFacts {
            frame_max: 131_072,
            ring: None,
        }),
        ..BrokerFacts::default()
    }
}

fn find<'a>(checks: &'a [Check], check: &str, subject: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.check == check && c.subject == subject)
        .unwrap_or_else(|| panic!("no {check} check on {subject} in {checks:#?}"))
}

const DLQ: &str = "rec.orders.dead-letter";

#[test]
fn on_3_10_the_policies_recorded_live_are_caught() {
    let checks = check_broker(&consumer(), &facts("3.10.8"));
    let dlq = find(&checks, "delivery-limit", DLQ);
    assert_eq!(dlq.status, Status::Fail, "{dlq:?}");
    assert!(
        dlq.detail.contains("20 (policy \"rec-dlq-limit\")"),
        "{dlq:?}"
    );
    let tier = find(&checks, "retry-ttl", "rec.orders.retry.5s");
    assert_eq!(tier.status, Status::Fail, "{tier:?}");
    assert!(
        tier.detail.contains("3000 ms (policy \"rec-tier-ttl\")"),
        "{tier:?}"
    );
    assert!(tier.detail.contains("configured for 5000 ms"), "{tier:?}");
    assert_eq!(
        find(&checks, "retry-ttl", "rec.orders.retry.30s").status,
        Status::Pass
    );
    let main = find(&checks, "delivery-limit", "rec.orders");
    assert_eq!(
        (main.status, main.detail.as_str()),
        (Status::Pass, "192 (queue argument)")
    );
    // The operator policy's cap, with the reject-publish overflow warren declares.
    let cap = find(&checks, "max-length", "rec.orders");
    assert_eq!(cap.status, Status::Warn, "{cap:?}");
    assert!(
        cap.detail.contains("operator policy \"rec-cap\""),
        "{cap:?}"
    );
    assert_eq!(
        find(&checks, "dead-letter-target", "rec.orders").status,
        Status::Pass
    );
    assert_eq!(
        find(&checks, "dead-letter-target", DLQ).status,
        Status::Pass
    );
    assert!(
        find(&checks, "x-death", "broker")
            .detail
            .contains("3.10.8 reads x-death")
    );
    assert!(
        find(&checks, "default-delivery-limit", "broker")
            .detail
            .contains("no default delivery limit")
    );
    // Flags of a plugin enabled after the node first started stay off until
    // enabled by hand; the recording caught two.
    let flags = find(&checks, "feature-flags", "broker");
    assert_eq!(flags.status, Status::Warn, "{flags:?}");
    assert!(flags.detail.contains("drop_unroutable_metric"), "{flags:?}");
    assert!(Report::new(checks).failed());
}

#[test]
fn on_3_13_a_negative_limit_dead_letters_everything() {
    let checks = check_broker(&consumer(), &facts("3.13.7"));
    let dlq = find(&checks, "delivery-limit", DLQ);
    assert_eq!(dlq.status, Status::Fail, "{dlq:?}");
    assert!(dlq.detail.contains("0 (queue argument)"), "{dlq:?}");
    assert!(
        dlq.detail.contains("a negative limit on 3.13.7 means 0"),
        "{dlq:?}"
    );
    let flags = find(&checks, "feature-flags", "broker");
    assert_eq!(flags.status, Status::Warn);
    assert!(flags.detail.contains("message_containers"), "{flags:?}");
    // 3.13.3 put back the counting 3.13.0 dropped by mistake.
    assert!(
        find(&checks, "x-death", "broker")
            .detail
            .contains("3.13.7 reads x-death")
    );
}

#[test]
fn on_4_0_a_queue_without_a_limit_gets_twenty() {
    let checks = check_broker(&consumer(), &facts("4.0.1"));
    let dlq = find(&checks, "delivery-limit", DLQ);
    assert_eq!(dlq.status, Status::Fail, "{dlq:?}");
    assert!(dlq.detail.contains("20 (broker default)"), "{dlq:?}");
    assert!(
        dlq.detail.contains("the broker's default applies"),
        "{dlq:?}"
    );
    // -1 by argument under a policy of 20: the larger holds, 20, below the
    // backstop; the queue dead-letters, so a warning.
    let main = find(&checks, "delivery-limit", "rec.orders");
    assert_eq!(main.status, Status::Warn, "{main:?}");
    assert!(
        main.detail.contains("20 (policy \"rec-main-limit\")"),
        "{main:?}"
    );
    assert!(
        find(&checks, "default-delivery-limit", "broker")
            .detail
            .contains("a limit of 20")
    );
    assert!(
        find(&checks, "x-death", "broker")
            .detail
            .contains("does not read x-death")
    );
    // The node's max_message_size unread: 4.0's default of 16 MiB stands in.
    let size = find(&checks, "max-message-size", "broker");
    assert!(
        size.detail
            .contains("16777216 bytes (the default of 4.0.1)"),
        "{size:?}"
    );
}

#[test]
fn on_4_3_the_topology_as_declared_passes_and_the_new_rules_are_named() {
    let checks = check_broker(&consumer(), &facts("4.3.0"));
    let failed: Vec<&Check> = checks.iter().filter(|c| c.status == Status::Fail).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(
        find(&checks, "delivery-count", "broker")
            .detail
            .contains("x-acquired-count")
    );
    assert!(
        find(&checks, "deprecated-features", "broker")
            .detail
            .contains("refuses transient non-exclusive queues")
    );
    let timeout = find(&checks, "consumer-timeout", "broker");
    assert_eq!(timeout.status, Status::Pass, "{timeout:?}");
    assert!(
        timeout
            .detail
            .contains("cancels the consumer (basic.cancel)"),
        "{timeout:?}"
    );
    // On 3.10 the same timeout closes the channel.
    let old = check_broker(&consumer(), &facts("3.10.8"));
    assert!(
        find(&old, "consumer-timeout", "broker")
            .detail
            .contains("closes the channel")
    );
}

#[test]
fn a_retry_handoff_resent_late_is_a_warning_with_the_setting_to_change() {
    let config = consumer();
    let with = |resend: Option<u64>| {
        let mut f = facts("3.10.8");
        let mut n = node(Some(1_800_000), None);
        n.dead_letter_resend_ms = resend;
        f.node = Some(n);
        find(&check_broker(&config, &f), "retry-handoff", "broker").clone()
    };
    let default = with(Some(180_000));
    assert_eq!(default.status, Status::Warn, "{default:?}");
    assert!(default.detail.contains("180000 ms"), "{default:?}");
    assert!(
        default
            .fix
            .contains("dead_letter_worker_publisher_confirm_timeout"),
        "{default:?}"
    );
    // Unset: the default every version with the worker has.
    let unset = with(None);
    assert_eq!(unset.status, Status::Warn);
    assert!(unset.detail.contains("180000 ms (unset"), "{unset:?}");
    assert_eq!(with(Some(15_000)).status, Status::Pass);
    // Classic tiers hand nothing back through the worker.
    let classic = ConsumerConfig::builder("rec", "rec.orders")
        .with_queue_type(warren::topology::QueueType::Classic)
        .build()
        .unwrap();
    let mut f = facts("3.10.8");
    f.node = None;
    let check = find(&check_broker(&classic, &f), "retry-handoff", "broker").clone();
    assert_eq!(check.status, Status::Pass, "{check:?}");
    // Quorum tiers on a node not read: skipped, saying why.
    f.node_missing = Some("rabbitmqctl not found".into());
    let skipped = find(&check_broker(&config, &f), "retry-handoff", "broker").clone();
    assert_eq!(skipped.status, Status::Skip);
    assert!(
        skipped.detail.contains("rabbitmqctl not found"),
        "{skipped:?}"
    );
}

#[test]
fn consumer_timeout_against_what_warren_holds() {
    let config = consumer();
    let with = |timeout| {
        let mut f = facts("3.10.8");
        f.node = Some(node(timeout, None));
        find(&check_broker(&config, &f), "consumer-timeout", "broker").clone()
    };
    // The solo-run timeout is 60 s by default: a timeout at it fires first.
    assert_eq!(with(Some(60_000)).status, Status::Fail);
    assert_eq!(with(Some(900_000)).status, Status::Warn);
    assert_eq!(with(Some(1_800_000)).status, Status::Pass);
    assert_eq!(with(None).status, Status::Pass);
    // Unset on 4.3.3 and later: a day, not off.
    let mut later = facts("4.3.0");
    later.api.as_mut().unwrap().version = Version::parse("4.3.3");
    later.node = Some(node(None, None));
    let day = find(&check_broker(&config, &later), "consumer-timeout", "broker").clone();
    assert!(
        day.detail.starts_with("86400000 ms (unset on the node"),
        "{day:?}"
    );
    let mut unread = facts("3.10.8");
    unread.node = None;
    unread.node_missing = Some("rabbitmqctl not found".into());
    let skipped = find(
        &check_broker(&config, &unread),
        "consumer-timeout",
        "broker",
    )
    .clone();
    assert_eq!(skipped.status, Status::Skip);
    assert!(
        skipped.detail.contains("rabbitmqctl not found"),
        "{skipped:?}"
    );
}

#[test]
fn message_and_frame_sizes() {
    let config = consumer();
    let mut f = facts("3.10.8");
    f.node = Some(node(Some(1_800_000), Some(512 * 1024)));
    let size = find(&check_broker(&config, &f), "max-message-size", "broker").clone();
    assert_eq!(size.status, Status::Warn, "{size:?}");
    f.node = Some(node(Some(1_800_000), Some(134_217_728)));
    assert_eq!(
        find(&check_broker(&config, &f), "max-message-size", "broker").status,
        Status::Pass
    );
    for (frame, status) in [
        (4096, Status::Fail),
        (16_384, Status::Warn),
        (131_072, Status::Pass),
    ] {
        f.connection = Some(ConnectionFacts {
            frame_max: frame,
            ring: None,
        });
        let check = find(&check_broker(&config, &f), "frame-size", "broker").clone();
        assert_eq!(check.status, status, "{check:?}");
    }
}

#[test]
fn without_the_management_api_the_queue_checks_are_skipped_not_failed() {
    let facts = BrokerFacts {
        api_missing: Some("cannot reach the management API at http://h:15672/".into()),
        node_missing: Some("rabbitmqctl was not asked".into()),
        connection_missing: Some("cannot connect".into()),
        ..BrokerFacts::default()
    };
    let report = Report::new(check_broker(&consumer(), &facts));
    assert!(!report.failed(), "{}", report.text());
    let api = find(&report.checks, "management-api", "broker");
    assert_eq!(api.status, Status::Skip);
    assert!(api.detail.contains("http://h:15672/"), "{api:?}");
    assert!(
        !report
            .checks
            .iter()
            .any(|c| c.subject.starts_with("rec.orders"))
    );
}

#[test]
fn a_partitioned_consumer_needs_the_plugin_and_an_intact_ring() {
    let config = ConsumerConfig::builder("rec", "rec.credits")
        .partitioned("rec.credits.hash", 2)
        .build()
        .unwrap();
    let mut f = facts("3.10.8");
    let api = f.api.as_mut().unwrap();
    api.exchange_types.retain(|t| t != "x-consistent-hash");
    for queue in warren::topology::Topology::for_consumer(&config).queue_names() {
        api.queues.insert(queue.to_owned(), None);
    }
    f.connection = Some(ConnectionFacts {
        frame_max: 131_072,
        ring: Some(Err("partition queue \"rec.credits.1\" is missing".into())),
    });
    let checks = check_broker(&config, &f);
    assert_eq!(
        find(&checks, "consistent-hash-plugin", "broker").status,
        Status::Fail
    );
    assert_eq!(find(&checks, "hash-ring", "broker").status, Status::Fail);
    // Partition queues not declared yet are named, each.
    assert_eq!(
        find(&checks, "queue-exists", "rec.credits.0").status,
        Status::Warn
    );
}

#[test]
fn the_management_client_never_shows_its_password() {
    let api = Management::new(&BrokerAccess {
        amqp_url: "amqp://a:b@rabbit-1:5672/%2f,amqp://a:b@rabbit-2:5672/%2f".into(),
        management_url: Some("http://monitor:s3cret@rabbit-1:15672".into()),
        ..BrokerAccess::default()
    })
    .unwrap();
    let shown = format!("{api:?}");
    assert!(
        shown.contains("monitor") && !shown.contains("s3cret"),
        "{shown}"
    );
    let bad = Management::new(&BrokerAccess {
        amqp_url: "amqp://guest:guest@localhost/%2f".into(),
        management_url: Some("http://monitor:s3cret@".into()),
        ..BrokerAccess::default()
    })
    .unwrap_err();
    assert!(!bad.contains("s3cret"), "{bad}");
}
