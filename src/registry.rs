//! The handler registry: an explicit allowlist from `(event type, schema version)`
//! to handler. Nothing is ever looked up by a name taken from a message beyond this
//! table.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use sqlx::Database;

use crate::failure::DeadLetterReason;
use crate::handler::{BatchHandler, ErasedHandler, Handler, Typed, TypedBatch};

/// The routing table of a consumer. By convention the event type ends in the
/// schema version (`.v1` for version 1), and is the routing key too.
///
/// ```
/// # use warren::{HandlerError, Message, Registry, Tx};
/// # use warren::sqlx::Sqlite;
/// # #[derive(serde::Deserialize)] struct PaidV1 { amount: f64 }
/// # #[derive(serde::Deserialize)] struct PaidV2 { amount: f64, method: String }
/// async fn paid_v1(msg: Message<PaidV1>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> { Ok(()) }
/// async fn paid_v2(msg: Message<PaidV2>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> { Ok(()) }
///
/// let routes = Registry::<Sqlite>::new()
///     .route("billing.invoice-paid.v1", 1, paid_v1)
///     .route("billing.invoice-paid.v2", 2, paid_v2);
/// assert_eq!(routes.len(), 2);
/// ```
pub struct Registry<DB: Database, S = ()> {
    /// By event type, then schema version: a delivery's route is found by
    /// the `&str` it carries, with no key to build.
    routes: HashMap<String, BTreeMap<u32, Arc<dyn ErasedHandler<DB>>>>,
    state: S,
}

impl<DB: Database> Clone for Registry<DB> {
    fn clone(&self) -> Self {
        Self {
            routes: self.routes.clone(),
            state: (),
        }
    }
}

impl<DB: Database> Registry<DB> {
    /// An empty table whose handlers take no state.
    pub fn new() -> Self {
        Self::with_state(())
    }
}

impl<DB: Database, S: Clone + Send + Sync + 'static> Registry<DB, S> {
    /// An empty table whose handlers may take `state` as their first argument,
    /// `State<S>` (see [`State`](crate::State)); handlers without it fit too.
    pub fn with_state(state: S) -> Self {
        Self {
            routes: HashMap::new(),
            state,
        }
    }

    /// The table with its state erased: each route already holds a clone of it.
    pub(crate) fn erase(self) -> Registry<DB> {
        Registry {
            routes: self.routes,
            state: (),
        }
    }

    /// Routes `event_type` at `schema_version` to `handler`, whose payload type `T`
    /// the message's payload must deserialize into.
    ///
    /// # Panics
    ///
    /// If the pair is already routed: two handlers for one version is a programming
    /// error, better found at start than in production.
    pub fn route<T, H, M>(self, event_type: &str, schema_version: u32, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        M: 'static,
        H: for<'a> Handler<'a, T, DB, S, M>,
    {
        let route = Arc::new(Typed::new(handler, self.state.clone(), None));
        self.insert(event_type, schema_version, route)
    }

    /// Routes `event_type` at `schema_version` to `handler`, like
    /// [`route`](Self::route), and derives an id from the typed payload
    /// for a message sent without one (no AMQP `message_id`, in a format
    /// whose id is optional: a bare payload). A message with an id keeps
    /// it; the derived key is computed again on every delivery and kept in
    /// a namespace of its own (`~key:` and the key, see
    /// [`Identity::key`](crate::format::Identity::key)), where no
    /// producer's id can meet it.
    ///
    /// The key must name exactly one business event: two different events
    /// with the same key are one message to the inbox, and the second is
    /// dropped as a duplicate. `{invoiceId}:paid` is such a key if an
    /// invoice is paid once; `{customerId}:credit-limit-set` is not.
    ///
    /// ```
    /// # use warren::{HandlerError, Message, Registry, Tx};
    /// # use warren::sqlx::Sqlite;
    /// #[derive(serde::Deserialize)]
    /// struct InvoicePaid { invoice_id: String }
    /// async fn paid(msg: Message<InvoicePaid>, tx: &mut Tx<Sqlite>) -> Result<(), HandlerError> { Ok(()) }
    ///
    /// let routes = Registry::<Sqlite>::new().route_keyed(
    ///     "billing.invoice-paid.v1",
    ///     1,
    ///     |p: &InvoicePaid| format!("{}:paid", p.invoice_id),
    ///     paid,
    /// );
    /// assert_eq!(routes.len(), 1);
    /// ```
    ///
    /// # Panics
    ///
    /// If the pair is already routed.
    pub fn route_keyed<T, K, H, M>(
        self,
        event_type: &str,
        schema_version: u32,
        key: K,
        handler: H,
    ) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        K: Fn(&T) -> String + Send + Sync + 'static,
        M: 'static,
        H: for<'a> Handler<'a, T, DB, S, M>,
    {
        let route = Arc::new(Typed::new(handler, self.state.clone(), Some(Arc::new(key))));
        self.insert(event_type, schema_version, route)
    }

    /// Routes `event_type` at `schema_version` to a batch handler: one call
    /// with every new message of this route in a transaction
    /// ([`Batch`](crate::Batch)), for set-based writes. Each message is still
    /// claimed in the inbox one by one, duplicates never reach the handler,
    /// and each gets its own outcome (see [`BatchError`](crate::BatchError)).
    /// A message alone (a suspect, a lane, low load) comes as a batch of one.
    ///
    /// ```
    /// # use warren::{Batch, BatchResult, Registry, Tx};
    /// # use warren::sqlx::Sqlite;
    /// # #[derive(serde::Deserialize)] struct PaidV1 { amount: i64 }
    /// async fn credit_points(batch: Batch<PaidV1>, tx: &mut Tx<Sqlite>) -> BatchResult {
    ///     Ok(())
    /// }
    ///
    /// let routes = Registry::<Sqlite>::new().route_batch("billing.invoice-paid.v1", 1, credit_points);
    /// assert_eq!(routes.len(), 1);
    /// ```
    ///
    /// # Panics
    ///
    /// If the pair is already routed.
    pub fn route_batch<T, H, M>(self, event_type: &str, schema_version: u32, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        M: 'static,
        H: for<'a> BatchHandler<'a, T, DB, S, M>,
    {
        let route = Arc::new(TypedBatch::new(handler, self.state.clone(), None));
        self.insert(event_type, schema_version, route)
    }

    /// A batch route ([`route_batch`](Self::route_batch)) that derives an id
    /// from the typed payload for a message sent without one, as
    /// [`route_keyed`](Self::route_keyed) does.
    ///
    /// # Panics
    ///
    /// If the pair is already routed.
    pub fn route_batch_keyed<T, K, H, M>(
        self,
        event_type: &str,
        schema_version: u32,
        key: K,
        handler: H,
    ) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        K: Fn(&T) -> String + Send + Sync + 'static,
        M: 'static,
        H: for<'a> BatchHandler<'a, T, DB, S, M>,
    {
        let route = Arc::new(TypedBatch::new(
            handler,
            self.state.clone(),
            Some(Arc::new(key)),
        ));
        self.insert(event_type, schema_version, route)
    }

    fn insert(
        mut self,
        event_type: &str,
        schema_version: u32,
        route: Arc<dyn ErasedHandler<DB>>,
    ) -> Self {
        let versions = self.routes.entry(event_type.to_owned()).or_default();
        assert!(
            !versions.contains_key(&schema_version),
            "{event_type} v{schema_version} is already routed to a handler"
        );
        versions.insert(schema_version, route);
        self
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.routes.values().map(BTreeMap::len).sum()
    }

    /// True if nothing is routed.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// The routed `(event type, schema version)` pairs, sorted.
    pub fn routes(&self) -> Vec<(&str, u32)> {
        self.keys()
    }

    pub(crate) fn lookup(
        &self,
        event_type: &str,
        schema_version: u32,
    ) -> Result<&Arc<dyn ErasedHandler<DB>>, (DeadLetterReason, String)> {
        let versions = self.routes.get(event_type);
        if let Some(handler) = versions.and_then(|v| v.get(&schema_version)) {
            return Ok(handler);
        }
        let known: Vec<u32> = versions
            .map(|v| v.keys().copied().collect())
            .unwrap_or_default();
        if known.is_empty() {
            Err((
                DeadLetterReason::UnknownEventType,
                format!("no handler for event type {event_type:?}"),
            ))
        } else {
            Err((
                DeadLetterReason::UnknownSchemaVersion,
                format!(
                    "no handler for {event_type:?} schema version {schema_version} (handled: {known:?})"
                ),
            ))
        }
    }
}

impl<DB: Database, S> Registry<DB, S> {
    /// The routed `(event type, schema version)` pairs, sorted.
    fn keys(&self) -> Vec<(&str, u32)> {
        let mut keys: Vec<_> = self
            .routes
            .iter()
            .flat_map(|(t, versions)| versions.keys().map(move |v| (t.as_str(), *v)))
            .collect();
        keys.sort_unstable();
        keys
    }
}

impl<DB: Database> Default for Registry<DB> {
    fn default() -> Self {
        Self::new()
    }
}

impl<DB: Database, S> fmt::Debug for Registry<DB, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("routes", &self.keys())
            .finish()
    }
}
