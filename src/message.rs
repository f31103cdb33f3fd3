//! What a handler is given: the message, typed, and the registry's state.

use crate::envelope::Metadata;

/// A message as a handler sees it: the typed payload and the envelope's metadata.
#[derive(Debug, Clone)]
pub struct Message<T> {
    /// The deserialized payload.
    pub payload: T,
    /// Message id, event type, schema version, correlation and causation ids.
    pub meta: Metadata,
    /// The broker's `redelivered` flag. Informational only: warren deduplicates
    /// every delivery whether or not it is set.
    pub redelivered: bool,
    /// Which attempt this is, from 1; retries through the tiers count up.
    pub attempt: u32,
    /// The partition key header (`partition-key`, or the header a partitioned
    /// consumer hashes on), when it is an AMQP long string. A producer sets it,
    /// so a handler that relies on it compares it with the payload: a key that
    /// differs from the entity's id would put the entity in two partitions.
    pub partition_key: Option<String>,
}

/// Shared state handed to every handler of a registry built with
/// [`Registry::with_state`](crate::Registry::with_state): an HTTP client, settings,
/// the exchange events go to. Cloned for each call, so keep it cheap to clone (an
/// `Arc` around anything large).
///
/// ```
/// use warren::{HandlerError, Message, Registry, State, Tx};
/// use warren::sqlx::Sqlite;
///
/// #[derive(Clone)]
/// struct Settings { exchange: String }
/// #[derive(serde::Deserialize)]
/// struct InvoicePaid { invoice_id: String }
///
/// async fn invoice_paid(
///     State(settings): State<Settings>,
///     msg: Message<InvoicePaid>,
///     tx: &mut Tx<Sqlite>,
/// ) -> Result<(), HandlerError> {
///     let _ = (&settings.exchange, &msg.payload.invoice_id, tx);
///     Ok(())
/// }
///
/// let routes = Registry::<Sqlite, _>::with_state(Settings { exchange: "billing.events".into() })
///     .route("billing.invoice-paid.v1", 1, invoice_paid);
/// assert_eq!(routes.len(), 1);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct State<S>(pub S);
