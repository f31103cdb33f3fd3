//! The invoice-paid handlers (schema versions 1 and 2) and billing's business
//! rules.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use warren::envelope::Metadata;
use warren::{Batch, BatchError, BatchResult, HandlerError, Outgoing, Registry, State, Tx};

use crate::amount::{Amount, shown};
use crate::db::{BillingDb, Payment};

/// The consumer name: billing's deduplication boundary.
pub const CONSUMER: &str = "billing";
/// Incoming event types.
pub const PAID_V1: &str = "billing.invoice-paid.v1";
/// The payment event with how and when it was paid.
pub const PAID_V2: &str = "billing.invoice-paid.v2";
/// The event billing emits through its outbox.
pub const RECORDED: &str = "billing.invoice-payment-recorded.v1";

/// ISO 4217 codes billing accepts; anything else is a producer defect.
pub const CURRENCIES: &[&str] = &[
    "AED", "AUD", "BRL", "CAD", "CHF", "CNY", "CZK", "DKK", "EUR", "GBP", "HKD", "HUF", "IDR",
    "ILS", "INR", "JPY", "KRW", "MXN", "MYR", "NOK", "NZD", "PHP", "PLN", "SAR", "SEK", "SGD",
    "THB", "TRY", "TWD", "USD", "ZAR",
];

/// The currencies in [`CURRENCIES`] without a minor unit (ISO 4217 exponent 0);
/// every other one has two decimal places.
pub const ZERO_DECIMAL: &[&str] = &["JPY", "KRW"];

/// Digits allowed after the decimal point in `currency` (ISO 4217 minor units).
pub fn minor_units(currency: &str) -> u32 {
    if ZERO_DECIMAL.contains(&currency) {
        0
    } else {
        2
    }
}

/// Identifiers (`invoiceId`, `customerId`, `paymentMethod`) are at most this many
/// characters long.
pub const MAX_ID_LEN: usize = 128;

/// True for the characters an identifier may hold.
fn id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/')
}

/// `invoiceId`, `customerId` and `paymentMethod` go into indexed text columns and
/// into events for other services. Checked here, so that a NUL or a megabyte id
/// has the same outcome on both databases (PostgreSQL would refuse them, SQLite
/// would store them) and the error text never carries the value itself.
pub(crate) fn identifier(field: &str, value: &str) -> Result<(), HandlerError> {
    let len = value.chars().count();
    if !(1..=MAX_ID_LEN).contains(&len) {
        return Err(HandlerError::permanent(format!(
            "{field} is {len} characters long; it must be 1 to {MAX_ID_LEN}"
        )));
    }
    if let Some((at, c)) = value.chars().enumerate().find(|&(_, c)| !id_char(c)) {
        return Err(HandlerError::permanent(format!(
            "{field} has {c:?} at position {at}; allowed are A-Z, a-z, 0-9 and - _ . : /"
        )));
    }
    Ok(())
}

/// `billing.invoice-paid.v1`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InvoicePaidV1 {
    /// The invoice paid.
    pub invoice_id: String,
    /// The customer who paid it.
    pub customer_id: String,
    /// The JSON text as the producer wrote it, parsed by [`Amount::from_json`]:
    /// going through `f64` would round it.
    pub amount: Box<RawValue>,
    /// ISO 4217 code.
    pub currency: String,
}

/// `billing.invoice-paid.v2`: v1 plus how and when it was paid.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InvoicePaidV2 {
    /// The invoice paid.
    pub invoice_id: String,
    /// The customer who paid it.
    pub customer_id: String,
    /// As in v1.
    pub amount: Box<RawValue>,
    /// ISO 4217 code.
    pub currency: String,
    /// How it was paid.
    pub payment_method: String,
    /// When it was paid, in UTC.
    pub paid_at_utc: DateTime<Utc>,
}

/// `billing.invoice-payment-recorded.v1`, written to the outbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PaymentRecorded {
    /// The invoice paid.
    pub invoice_id: String,
    /// The customer who paid it.
    pub customer_id: String,
    /// Exact decimal text.
    pub amount: String,
    /// ISO 4217 code.
    pub currency: String,
    /// An integer; above 2^53 for amounts that large, so read it as a big integer.
    pub loyalty_points: i128,
    /// The key a payment provider would have been given: the incoming message id.
    pub payment_reference: String,
}

/// Validates a payment against billing's rules. A violation is permanent: no retry
/// can make a negative amount positive.
fn payment(
    meta: &Metadata,
    invoice_id: &str,
    customer_id: &str,
    amount: &RawValue,
    currency: &str,
    paid_at: DateTime<Utc>,
    payment_method: Option<&str>,
) -> Result<Payment, HandlerError> {
    identifier("invoiceId", invoice_id)?;
    identifier("customerId", customer_id)?;
    if let Some(method) = payment_method {
        identifier("paymentMethod", method)?;
    }
    let value = Amount::from_json(amount.get()).map_err(HandlerError::permanent)?;
    if value.is_negative() {
        return Err(HandlerError::permanent(format!(
            "amount {value} is negative"
        )));
    }
    if !CURRENCIES.contains(&currency) {
        return Err(HandlerError::permanent(format!(
            "currency \"{}\" is not supported",
            shown(currency)
        )));
    }
    let allowed = minor_units(currency);
    if value.scale() > allowed {
        return Err(HandlerError::permanent(format!(
            "amount {value} has {} digits after the decimal point; {currency} allows {allowed}",
            value.scale()
        )));
    }
    Ok(Payment {
        invoice_id: invoice_id.to_owned(),
        customer_id: customer_id.to_owned(),
        amount: value.to_string(),
        points: value.floor(),
        currency: currency.to_owned(),
        paid_at,
        payment_method: payment_method.map(str::to_owned),
        // The key a payment provider would get for this step; the same on every
        // redelivery, so a retried provider call is recognized as the same call.
        payment_reference: warren::handler::idempotency_key(
            CONSUMER,
            &meta.message_id,
            "record-payment",
        ),
    })
}

/// The payment a message carries, or why it cannot be recorded now: a
/// violation of billing's rules (permanent), or the stand-in for a dependency
/// timing out (`cus_flaky*`, transient on the first two attempts).
fn payable(payment: Result<Payment, HandlerError>, attempt: u32) -> Result<Payment, HandlerError> {
    let payment = payment?;
    if payment.customer_id.starts_with("cus_flaky") && attempt <= 2 {
        return Err(HandlerError::transient(format!(
            "payment provider timed out (simulated, attempt {attempt})"
        )));
    }
    Ok(payment)
}

/// The payments of a batch, each with its message's id, if every message's
/// can be recorded now. Otherwise the messages whose cannot are named, with
/// nothing written: each gets its own outcome, and the others come again
/// without them.
fn all_payable<T>(
    batch: &Batch<T>,
    payments: impl Iterator<Item = Result<Payment, HandlerError>>,
) -> Result<Vec<(Payment, &str)>, BatchError> {
    let mut failed = Vec::new();
    let mut payable = Vec::with_capacity(batch.len());
    for (msg, payment) in batch.iter().zip(payments) {
        match payment {
            Ok(payment) => payable.push((payment, msg.meta.message_id.as_str())),
            Err(e) => failed.push((msg, e)),
        }
    }
    if !failed.is_empty() {
        return Err(BatchError::messages(failed));
    }
    Ok(payable)
}

/// The event a recorded payment emits.
fn recorded(payment: &Payment) -> Result<Outgoing, HandlerError> {
    Outgoing::new(
        RECORDED,
        1,
        &PaymentRecorded {
            invoice_id: payment.invoice_id.clone(),
            customer_id: payment.customer_id.clone(),
            amount: payment.amount.clone(),
            currency: payment.currency.clone(),
            loyalty_points: payment.points,
            payment_reference: payment.payment_reference.clone(),
        },
    )
    .map_err(HandlerError::permanent)
}

/// Writes `payable` (one for each message of `batch`) and one event each to
/// the outbox, in the transaction the batch's inbox claims are in: two
/// statements for the whole batch on PostgreSQL.
async fn write<B: BillingDb, T>(
    exchange: &str,
    batch: &Batch<T>,
    payable: &[(Payment, &str)],
    tx: &mut Tx<B>,
) -> BatchResult {
    B::record_payments(tx, payable).await?;
    let events = batch
        .iter()
        .zip(payable)
        .map(|(msg, (payment, _))| Ok((msg, recorded(payment)?)))
        .collect::<Result<Vec<_>, HandlerError>>()?;
    tx.publish_all(exchange, RECORDED, events)
        .await
        .map_err(HandlerError::from)?;
    Ok(())
}

/// The v1 handler, for a whole batch. Its state is the exchange its
/// outgoing events go to.
pub async fn paid_v1<B: BillingDb>(
    State(exchange): State<Arc<str>>,
    batch: Batch<InvoicePaidV1>,
    tx: &mut Tx<B>,
) -> BatchResult {
    let payments = batch.iter().map(|msg| {
        let p = &msg.payload;
        // v1 carries no payment time: the event's own time stands in.
        let payment = payment(
            &msg.meta,
            &p.invoice_id,
            &p.customer_id,
            &p.amount,
            &p.currency,
            // A bare payload may say nothing of when: its receipt then.
            msg.meta.occurred_at.unwrap_or_else(Utc::now),
            None,
        );
        payable(payment, msg.attempt)
    });
    let payable = all_payable(&batch, payments)?;
    write::<B, _>(&exchange, &batch, &payable, tx).await
}

/// The v2 handler, for a whole batch.
pub async fn paid_v2<B: BillingDb>(
    State(exchange): State<Arc<str>>,
    batch: Batch<InvoicePaidV2>,
    tx: &mut Tx<B>,
) -> BatchResult {
    let payments = batch.iter().map(|msg| {
        let p = &msg.payload;
        let payment = payment(
            &msg.meta,
            &p.invoice_id,
            &p.customer_id,
            &p.amount,
            &p.currency,
            p.paid_at_utc,
            Some(&p.payment_method),
        );
        payable(payment, msg.attempt)
    });
    let payable = all_payable(&batch, payments)?;
    write::<B, _>(&exchange, &batch, &payable, tx).await
}

/// The id of a v1 payment sent without one: `{invoiceId}:paid`.
pub fn paid_key(p: &InvoicePaidV1) -> String {
    format!("{}:paid", p.invoice_id)
}

/// billing's routing table: both schema versions side by side, each a batch
/// handler (every new message of a version in a transaction is recorded
/// set-based), sharing the exchange outgoing events go to.
pub fn routes<B: BillingDb>(exchange: &str) -> Registry<B, Arc<str>> {
    Registry::with_state(Arc::<str>::from(exchange))
        // A v1 payment sent with no id at all (a bare payload without a
        // message_id) is keyed by its invoice: an invoice is paid once.
        .route_batch_keyed(PAID_V1, 1, paid_key, paid_v1::<B>)
        .route_batch(PAID_V2, 2, paid_v2::<B>)
}

#[cfg(test)]
mod tests;
