//! A realistic stream of invoice-paid events: v1 and v2, duplicates, flaky
//! customers and poison, with what the outcome must be.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use serde::Serialize;
use serde_json::json;
use serde_json::value::RawValue;
use warren::Outgoing;
use warren::admin::DeadLetterReason;
use warren::broker::Publisher;
use warren::lapin::BasicProperties;

use crate::handlers::{CURRENCIES, InvoicePaidV1, InvoicePaidV2, PAID_V1, PAID_V2, minor_units};

/// What to publish.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    /// Unique valid invoices (flaky ones included).
    pub count: usize,
    /// Share of valid messages published a second time (0 to 1).
    pub duplicates: f64,
    /// Share of valid messages in schema version 2 (0 to 1).
    pub v2: f64,
    /// Poison messages, spread over the kinds of bad input.
    pub poison: usize,
    /// Messages from flaky customers (fail twice, then succeed); part of `count`.
    pub flaky: usize,
    /// Seed of the random choices, for a repeatable stream.
    pub seed: u64,
}

impl StreamSpec {
    /// Checks the numbers; the error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        for (flag, v) in [("--duplicates", self.duplicates), ("--v2", self.v2)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{flag} is a share from 0 to 1, got {v}"));
            }
        }
        if self.flaky > self.count {
            return Err(format!(
                "--flaky ({}) cannot exceed --count ({})",
                self.flaky, self.count
            ));
        }
        Ok(())
    }
}

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Planned {
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

/// The outcome a correct consumer must reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    /// Deliveries published (copies included).
    pub published: usize,
    /// Distinct messages.
    pub unique: usize,
    /// Distinct valid messages: each must be applied once.
    pub valid: usize,
    /// Extra copies of valid messages: each must be skipped as a duplicate.
    pub duplicates: usize,
    /// Valid messages from flaky customers.
    pub flaky: usize,
    /// Schema version 2 among the valid messages.
    pub v2: usize,
    /// Poison messages by the reason they must be dead-lettered with.
    pub poison: BTreeMap<String, usize>,
    /// Loyalty points: one credit of floor(amount) per valid message.
    pub loyalty_sum: i128,
}

/// The stream and its expected outcome.
pub struct Plan {
    pub messages: Vec<Planned>,
    pub expected: Expected,
}

fn envelope(event_type: &str, version: u32, payload: &impl Serialize) -> Outgoing {
    Outgoing::new(event_type, version, payload).expect("JSON values serialize")
}

fn planned(routing_key: &str, msg: &Outgoing) -> Planned {
    Planned {
        routing_key: routing_key.to_owned(),
        body: msg.body(),
        properties: msg.properties(),
    }
}

/// The poison kinds, in the order they are handed out.
const POISON: [DeadLetterReason; 5] = [
    DeadLetterReason::InvalidJson,
    DeadLetterReason::UnknownSchemaVersion,
    DeadLetterReason::Permanent, // negative amount
    DeadLetterReason::Permanent, // unsupported currency
    DeadLetterReason::UnknownEventType,
];

/// Builds the stream `spec` describes.
pub fn plan(spec: &StreamSpec) -> Plan {
    let mut rng = fastrand::Rng::with_seed(spec.seed);
    let mut expected = Expected::default();
    let mut valid = Vec::new();
    for i in 0..spec.count {
        let currency = CURRENCIES[rng.usize(..CURRENCIES.len())];
        // Exact decimal text in the currency's minor units, never through a float.
        let amount = if minor_units(currency) == 0 {
            let units = rng.i64(1..1000);
            expected.loyalty_sum += i128::from(units);
            units.to_string()
        } else {
            let cents = rng.i64(100..100_000);
            expected.loyalty_sum += i128::from(cents / 100);
            format!("{}.{:02}", cents / 100, cents % 100)
        };
        let amount = RawValue::from_string(amount).expect("a decimal is a JSON number");
        let customer = if i < spec.flaky {
            format!("cus_flaky_{i}")
        } else {
            format!("cus_{}", rng.u32(1..500))
        };
        let invoice = format!("inv_{}", uuid::Uuid::now_v7().simple());
        let v2 = rng.f64() < spec.v2;
        let msg = if v2 {
            expected.v2 += 1;
            envelope(
                PAID_V2,
                2,
                &InvoicePaidV2 {
                    invoice_id: invoice,
                    customer_id: customer,
                    amount,
                    currency: currency.to_owned(),
                    payment_method: "card".to_owned(),
                    paid_at_utc: Utc::now(),
                },
            )
        } else {
            envelope(
                PAID_V1,
                1,
                &InvoicePaidV1 {
                    invoice_id: invoice,
                    customer_id: customer,
                    amount,
                    currency: currency.to_owned(),
                },
            )
        };
        let key = if v2 { PAID_V2 } else { PAID_V1 };
        valid.push((key, msg, i < spec.flaky));
    }
    expected.valid = valid.len();
    expected.flaky = spec.flaky;

    let mut messages = Vec::new();
    let mut copies = Vec::new();
    for (key, msg, flaky) in &valid {
        messages.push(planned(key, msg));
        // Flaky messages are not duplicated, so that the retry count is exact.
        if !flaky && rng.f64() < spec.duplicates {
            copies.push(planned(key, msg));
        }
    }
    expected.duplicates = copies.len();
    // Half the copies right behind their original's neighbours, half at the end.
    for (n, copy) in copies.into_iter().enumerate() {
        if n % 2 == 0 {
            let at = rng.usize(..=messages.len());
            messages.insert(at, copy);
        } else {
            messages.push(copy);
        }
    }

    for n in 0..spec.poison {
        let reason = POISON[n % POISON.len()];
        let good = json!({"invoiceId": format!("inv_poison_{n}"), "customerId": "cus_1", "amount": 10, "currency": "EUR"});
        let p = match (n % POISON.len(), reason) {
            (_, DeadLetterReason::InvalidJson) => {
                let id = uuid::Uuid::now_v7().to_string();
                Planned {
                    routing_key: PAID_V1.into(),
                    body: format!("{{\"messageId\": \"{id}\", \"payload\": ").into_bytes(),
                    properties: BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_content_type("application/json".into()),
                }
            }
            // A known event type in a version nobody registered.
            (_, DeadLetterReason::UnknownSchemaVersion) => {
                planned(PAID_V2, &envelope(PAID_V2, 3, &good))
            }
            (_, DeadLetterReason::UnknownEventType) => planned(
                "billing.invoice-paid.refund",
                &envelope("billing.invoice-paid.refund", 1, &good),
            ),
            (2, _) => planned(
                PAID_V1,
                &envelope(
                    PAID_V1,
                    1,
                    &json!({"invoiceId": format!("inv_poison_{n}"), "customerId": "cus_1", "amount": -5, "currency": "EUR"}),
                ),
            ),
            _ => planned(
                PAID_V1,
                &envelope(
                    PAID_V1,
                    1,
                    &json!({"invoiceId": format!("inv_poison_{n}"), "customerId": "cus_1", "amount": 5, "currency": "XXX"}),
                ),
            ),
        };
        *expected
            .poison
            .entry(reason.as_str().to_owned())
            .or_default() += 1;
        let at = rng.usize(..=messages.len());
        messages.insert(at, p);
    }
    expected.unique = expected.valid + spec.poison;
    expected.published = messages.len();
    Plan { messages, expected }
}

/// Publishes the plan to `exchange`, each message confirmed by the broker.
pub async fn publish(
    connection: Arc<warren::lapin::Connection>,
    exchange: &str,
    plan: &Plan,
) -> Result<(), String> {
    let publisher = Publisher::new(connection);
    for chunk in plan.messages.chunks(200) {
        let items: Vec<_> = chunk
            .iter()
            .map(|m| warren::broker::BatchItem {
                exchange,
                routing_key: &m.routing_key,
                body: &m.body,
                properties: m.properties.clone(),
            })
            .collect();
        for result in publisher.publish_batch(&items).await {
            result.map_err(|e| format!("publish failed: {e}"))?;
        }
    }
    Ok(())
}
