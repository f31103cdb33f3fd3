//! A realistic stream of invoice-paid events: v1 and v2, duplicates, flaky
//! customers and poison, with what the outcome must be.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use serde::Serialize;
use serde_json::json;
use serde_json::value::RawValue;
use warren::broker::Publisher;
use warren::lapin::BasicProperties;
use warren::{Outgoing, OutgoingFormat};
use warren_admin::DeadLetterReason;

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
    /// Share of valid messages published as a producer that is not warren
    /// would (0 to 1): CloudEvents in both modes and bare payloads, with and
    /// without an id, in turn (see [`Form`]); the rest in warren's envelope.
    pub foreign: f64,
    /// Seed of the random choices, for a repeatable stream.
    pub seed: u64,
}

/// How a valid invoice is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Form {
    /// warren's envelope, as warren's outbox sends it.
    Warren,
    /// A CloudEvent, structured mode (`application/cloudevents+json`).
    CloudEventStructured,
    /// A CloudEvent, binary mode (`ce-` headers, the body the data).
    CloudEventBinary,
    /// The bare payload, its id in the AMQP `message_id`, its type in `type`.
    Bare,
    /// The bare payload with no id at all: billing keys a v1 payment by
    /// `{invoiceId}:paid` (a v2 payment goes as [`Form::Bare`]).
    BareWithoutId,
}

impl Form {
    /// The foreign forms, in the order they are handed out.
    const FOREIGN: [Form; 4] = [
        Form::CloudEventStructured,
        Form::CloudEventBinary,
        Form::Bare,
        Form::BareWithoutId,
    ];

    /// Its name in a file name (the bench's flamegraphs).
    pub fn slug(self) -> String {
        self.name().replace(", ", "-").replace(' ', "-")
    }

    /// Its name in the demo's table.
    pub fn name(self) -> &'static str {
        match self {
            Form::Warren => "warren envelope",
            Form::CloudEventStructured => "cloudevent, structured",
            Form::CloudEventBinary => "cloudevent, binary",
            Form::Bare => "bare payload",
            Form::BareWithoutId => "bare payload, no id",
        }
    }
}

/// `msg` as a producer publishing in `form` would send it: the same event
/// type, payload and (where the form carries one) id.
pub fn in_form(form: Form, routing_key: &str, msg: &Outgoing) -> Planned {
    let source = "/billing/demo";
    let format = match form {
        Form::Warren => OutgoingFormat::Warren,
        Form::CloudEventStructured => OutgoingFormat::cloud_events_structured(source),
        Form::CloudEventBinary => OutgoingFormat::cloud_events_binary(source),
        Form::Bare | Form::BareWithoutId => OutgoingFormat::Bare,
    };
    let msg = msg.clone().with_format(format);
    let mut planned = planned(routing_key, &msg);
    if form == Form::BareWithoutId && msg.meta().schema_version == 1 {
        // A producer that sends no id at all: no `message_id`, nor a
        // correlation id of its own.
        let p = &planned.properties;
        let mut bare = BasicProperties::default().with_delivery_mode(2);
        if let Some(v) = p.content_type() {
            bare = bare.with_content_type(v.clone());
        }
        if let Some(v) = p.kind() {
            bare = bare.with_type(v.clone());
        }
        if let Some(v) = p.timestamp() {
            bare = bare.with_timestamp(*v);
        }
        if let Some(v) = p.headers() {
            bare = bare.with_headers(v.clone());
        }
        planned.properties = bare;
    }
    planned
}

impl StreamSpec {
    /// Checks the numbers; the error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        for (flag, v) in [
            ("--duplicates", self.duplicates),
            ("--v2", self.v2),
            ("--foreign", self.foreign),
        ] {
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
    /// The routing key it is published with.
    pub routing_key: String,
    /// Its body.
    pub body: Vec<u8>,
    /// Its properties, headers included.
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
    /// Valid messages by the form they were published in.
    pub forms: BTreeMap<Form, usize>,
}

/// The stream and its expected outcome.
pub struct Plan {
    /// The messages, in publishing order.
    pub messages: Vec<Planned>,
    /// What a correct consumer ends with.
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
    // Cut-off JSON: none of the formats billing reads takes it.
    DeadLetterReason::UnrecognizedFormat,
    DeadLetterReason::UnknownSchemaVersion,
    DeadLetterReason::Permanent, // negative amount
    DeadLetterReason::Permanent, // unsupported currency
    DeadLetterReason::UnknownEventType,
];

/// Builds the stream `spec` describes.
pub fn plan(spec: &StreamSpec) -> Plan {
    plan_forms(spec, |i, rng| {
        if rng.f64() < spec.foreign {
            Form::FOREIGN[i % Form::FOREIGN.len()]
        } else {
            Form::Warren
        }
    })
}

/// A plan whose valid messages are all in `form` (a v2 payment without an
/// id goes with one, as in [`plan`]); `spec.foreign` is not read.
pub fn plan_in(form: Form, spec: &StreamSpec) -> Plan {
    plan_forms(spec, |_, _| form)
}

fn plan_forms(spec: &StreamSpec, form_of: impl Fn(usize, &mut fastrand::Rng) -> Form) -> Plan {
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
        let form = form_of(i, &mut rng);
        let counted = match form {
            Form::BareWithoutId if v2 => Form::Bare,
            form => form,
        };
        *expected.forms.entry(counted).or_default() += 1;
        valid.push((key, in_form(form, key, &msg), i < spec.flaky));
    }
    expected.valid = valid.len();
    expected.flaky = spec.flaky;

    let mut messages = Vec::new();
    let mut copies = Vec::new();
    for (_, planned, flaky) in &valid {
        messages.push(planned.clone());
        // Flaky messages are not duplicated, so that the retry count is exact.
        if !flaky && rng.f64() < spec.duplicates {
            copies.push(planned.clone());
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
            (_, DeadLetterReason::UnrecognizedFormat) => {
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
