//! billing's handlers through warren's test kit: no broker, an SQLite database
//! in memory, billing's real routing table and consumer configuration.

use std::time::Duration;

use warren::sqlx::Sqlite;
use warren::testing::{OutboxMessage, Settled, TestConsumer, sqlite_in_memory};
use warren::{Outgoing, SqliteStore};
use warren_admin::DeadLetterReason;

use super::*;
use crate::db::{BillingDb, Counts};
use crate::service::{Names, Settings, consumer_config};

async fn kit() -> TestConsumer<SqliteStore> {
    let store = sqlite_in_memory().await.unwrap();
    Sqlite::create_tables(&store).await.unwrap();
    let names = Names::new("billing");
    let settings = Settings::default();
    TestConsumer::new(
        consumer_config(&names, &settings).unwrap(),
        store,
        routes::<Sqlite>(&names.exchange()),
    )
    .await
    .unwrap()
}

/// The amount as the producer wrote it: the JSON text is kept exactly.
fn amount(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_owned()).unwrap()
}

fn v1(invoice: &str, customer: &str, value: &str) -> Outgoing {
    let payload = InvoicePaidV1 {
        invoice_id: invoice.into(),
        customer_id: customer.into(),
        amount: amount(value),
        currency: "EUR".into(),
    };
    Outgoing::new(PAID_V1, 1, &payload).unwrap()
}

fn v2(invoice: &str, customer: &str, value: &str) -> Outgoing {
    let payload = InvoicePaidV2 {
        invoice_id: invoice.into(),
        customer_id: customer.into(),
        amount: amount(value),
        currency: "USD".into(),
        payment_method: "card".into(),
        paid_at_utc: "2026-01-02T03:04:05Z".parse().unwrap(),
    };
    Outgoing::new(PAID_V2, 2, &payload).unwrap()
}

async fn counts(kit: &TestConsumer<SqliteStore>) -> Counts {
    Sqlite::counts(kit.store(), CONSUMER).await.unwrap()
}

async fn recorded(kit: &TestConsumer<SqliteStore>) -> Vec<(OutboxMessage, PaymentRecorded)> {
    kit.outbox()
        .await
        .unwrap()
        .into_iter()
        .map(|m| {
            assert_eq!(
                (m.exchange.as_str(), m.routing_key.as_str()),
                ("billing.events", RECORDED)
            );
            assert_eq!(m.meta.event_type, RECORDED);
            let payload = m.payload().unwrap();
            (m, payload)
        })
        .collect()
}

fn id(message: &Outgoing) -> Option<&str> {
    Some(message.meta().message_id.as_str())
}

#[tokio::test]
async fn v1_and_v2_each_credit_points_and_record_one_event() {
    let kit = kit().await;
    let first = v1("in_1", "cus_a", "12.50");
    let second = v2("in_2", "cus_b", "7");
    assert_eq!(kit.deliver(&first).await, Settled::Applied);
    assert_eq!(kit.deliver(&second).await, Settled::Applied);
    let c = counts(&kit).await;
    assert_eq!((c.invoices_paid, c.loyalty_rows, c.loyalty_sum), (2, 2, 19));
    let events = recorded(&kit).await;
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].0.meta.causation_id.as_deref(), id(&first));
    assert_eq!(events[0].1.loyalty_points, 12);
    assert_eq!(events[0].1.amount, "12.50");
    assert_eq!(events[1].0.meta.causation_id.as_deref(), id(&second));
    assert_eq!(events[1].1.currency, "USD");
}

#[tokio::test]
async fn a_negative_amount_is_dead_lettered_at_once() {
    let kit = kit().await;
    let settled = kit.deliver(&v1("in_1", "cus_a", "-5")).await;
    let Settled::DeadLettered {
        reason,
        error,
        attempts,
    } = settled
    else {
        panic!("not dead-lettered: {settled:?}");
    };
    assert_eq!((reason, attempts), (DeadLetterReason::Permanent, 1));
    assert!(error.contains("negative"), "{error}");
    assert_eq!(kit.dead_letters()[0].original_routing_key, PAID_V1);
    assert_eq!(counts(&kit).await.loyalty_rows, 0);
    assert!(recorded(&kit).await.is_empty());
}

#[tokio::test]
async fn a_flaky_customer_fails_twice_then_is_applied_on_attempt_3() {
    let kit = kit().await;
    let m = v2("in_1", "cus_flaky_1", "10");
    assert!(matches!(
        kit.deliver(&m).await,
        Settled::Retried { attempt: 1, delay, .. } if delay == Duration::from_secs(5)
    ));
    assert!(matches!(
        kit.next_attempt().await,
        Settled::Retried { attempt: 2, delay, .. } if delay == Duration::from_secs(30)
    ));
    assert_eq!(kit.next_attempt().await, Settled::Applied);
    assert_eq!(
        counts(&kit).await.loyalty_rows,
        1,
        "failed attempts rolled back"
    );
    assert_eq!(recorded(&kit).await.len(), 1);

    // Straight to attempt 3, as the copy from the second tier arrives.
    let later = v1("in_2", "cus_flaky_2", "3");
    assert_eq!(kit.deliver_attempt(&later, 3).await, Settled::Applied);
    assert_eq!(counts(&kit).await.loyalty_rows, 2);
}

#[tokio::test]
async fn a_duplicate_credits_nothing_and_records_no_event() {
    let kit = kit().await;
    let m = v1("in_1", "cus_a", "42");
    assert_eq!(kit.deliver(&m).await, Settled::Applied);
    // The producer published it twice: no redelivered flag, still a duplicate.
    assert_eq!(kit.deliver(&m).await, Settled::Duplicate);
    assert_eq!(kit.redeliver(&m).await, Settled::Duplicate);
    let c = counts(&kit).await;
    assert_eq!((c.loyalty_rows, c.loyalty_sum, c.inbox_rows), (1, 42, 1));
    assert_eq!(recorded(&kit).await.len(), 1);
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_is_applied_once() {
    let kit = kit().await;
    let m = v2("in_1", "cus_a", "9.99");
    assert_eq!(kit.crash_after_commit(&m).await, Settled::Duplicate);
    let c = counts(&kit).await;
    assert_eq!((c.invoices_paid, c.loyalty_rows, c.loyalty_sum), (1, 1, 9));
    let events = recorded(&kit).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0.meta.causation_id.as_deref(), id(&m));
}

/// One batch of both versions, a poison message, a flaky customer, a copy of
/// an earlier message and a second payment of the same invoice: the handlers
/// are called once per version, each message gets its own outcome, and the
/// invoice paid twice keeps its first payment's values and credits both.
#[tokio::test]
async fn a_batch_of_every_kind_records_each_payment_once() {
    let kit = kit().await;
    let first = v1("in_1", "cus_a", "12.50");
    let again = v2("in_1", "cus_a", "99");
    let negative = v1("in_2", "cus_b", "-1");
    let flaky = v1("in_3", "cus_flaky_1", "3");
    let other = v2("in_4", "cus_c", "7");
    let settled = kit
        .deliver_batch(&[
            first.clone(),
            again.clone(),
            negative,
            flaky,
            first.clone(),
            other,
        ])
        .await;
    assert_eq!(settled[0], Settled::Applied);
    assert_eq!(settled[1], Settled::Applied);
    assert!(
        matches!(
            settled[2],
            Settled::DeadLettered {
                reason: DeadLetterReason::Permanent,
                ..
            }
        ),
        "{:?}",
        settled[2]
    );
    assert!(
        matches!(settled[3], Settled::Retried { attempt: 1, .. }),
        "{:?}",
        settled[3]
    );
    assert_eq!(settled[4], Settled::Duplicate);
    assert_eq!(settled[5], Settled::Applied);
    let c = counts(&kit).await;
    assert_eq!((c.invoices_paid, c.loyalty_rows), (2, 3), "{c:?}");
    assert_eq!(c.loyalty_sum, 12 + 99 + 7, "one credit per message");
    let paid: String = sqlx::query_scalar("SELECT amount FROM invoices WHERE invoice_id = 'in_1'")
        .fetch_one(kit.store().pool())
        .await
        .unwrap();
    assert_eq!(paid, "12.50", "the first payment's values stay");
    let events = recorded(&kit).await;
    assert_eq!(events.len(), 3);
    let causes: Vec<_> = events
        .iter()
        .map(|(m, _)| m.meta.causation_id.clone())
        .collect();
    assert!(causes.contains(&id(&first).map(str::to_owned)));
    assert!(causes.contains(&id(&again).map(str::to_owned)));
    assert!(matches!(
        kit.next_attempt().await,
        Settled::Retried { attempt: 2, .. }
    ));
    assert_eq!(kit.next_attempt().await, Settled::Applied);
    assert_eq!(counts(&kit).await.loyalty_rows, 4, "the flaky one, once");
}
