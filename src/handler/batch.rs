//! Batch handlers: one call for every new message of a route in a
//! transaction, so that a handler can write them set-based (one `INSERT ...
//! SELECT FROM unnest(...)` for N rows) instead of a statement per message.
//!
//! The rule does not change: each message is claimed in the inbox of the
//! same transaction, duplicates never reach the handler, and every message
//! gets its own outcome. What a batch handler decides is which messages
//! failed, if any; the engine does the rest:
//!
//! - `Ok(())`: every message of the batch applied (or was stale at its
//!   version gate), committed with the claims.
//! - [`BatchError::messages`]: those messages fail, each decided alone
//!   (retry tier or dead letter); the transaction rolls back, since a
//!   savepoint cannot split one set-based statement, and the others run
//!   again in a new one, without them.
//! - [`BatchError::all`] (or `?` on a database error): the failure names no
//!   message, so each message runs again in a transaction of its own, where
//!   the failure is its own: a set-based insert that one bad row breaks
//!   finds that row this way.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use sqlx::Database;

use super::{Call, Delivered, ErasedHandler, KeyFn, Stateless, Unbound, WithState, message_of};
use crate::envelope::Metadata;
use crate::failure::HandlerError;
use crate::message::{Message, State};
use crate::store::tx::Tx;

/// The new messages of one route in a transaction, in the order the broker
/// delivered them: claimed in the inbox, none a duplicate, at most one per
/// message id.
#[derive(Debug, Clone)]
pub struct Batch<T> {
    messages: Vec<Message<T>>,
}

impl<T> Batch<T> {
    /// A batch of `messages`, for a test that calls a batch handler itself.
    pub fn new(messages: Vec<Message<T>>) -> Self {
        Self { messages }
    }

    /// How many messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Never true for a batch warren hands a handler.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The messages, in broker order.
    pub fn iter(&self) -> std::slice::Iter<'_, Message<T>> {
        self.messages.iter()
    }

    /// The messages, in broker order.
    pub fn messages(&self) -> &[Message<T>] {
        &self.messages
    }
}

impl<'b, T> IntoIterator for &'b Batch<T> {
    type Item = &'b Message<T>;
    type IntoIter = std::slice::Iter<'b, Message<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.messages.iter()
    }
}

/// What a batch handler returns.
pub type BatchResult = Result<(), BatchError>;

/// How a batch handler failed: some of its messages, or the batch as a whole.
///
/// `?` on a [`HandlerError`] or a database error fails the whole batch.
///
/// ```
/// use warren::{Batch, BatchError, BatchResult, HandlerError, Tx};
/// # #[derive(serde::Deserialize)] struct Paid { amount: i64 }
/// async fn credit(batch: Batch<Paid>, tx: &mut Tx<warren::sqlx::Sqlite>) -> BatchResult {
///     let negative: Vec<_> = batch
///         .iter()
///         .filter(|m| m.payload.amount < 0)
///         .map(|m| (m, HandlerError::permanent("negative amount")))
///         .collect();
///     if !negative.is_empty() {
///         // They are dead-lettered; the rest run again without them.
///         return Err(BatchError::messages(negative));
///     }
///     // ... one statement for the whole batch, on tx ...
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct BatchError {
    pub(crate) failure: BatchFailure,
}

/// What a [`BatchError`] says failed.
#[derive(Debug)]
pub(crate) enum BatchFailure {
    /// The batch as a whole: each message runs again alone.
    All(HandlerError),
    /// These messages, by message id.
    Messages(Vec<(String, HandlerError)>),
}

impl BatchError {
    /// The batch failed as a whole: no message is named, so each runs again
    /// in a transaction of its own, where what fails is its own.
    pub fn all(error: impl Into<HandlerError>) -> Self {
        Self {
            failure: BatchFailure::All(error.into()),
        }
    }

    /// These messages failed, each with its own error (transient, permanent,
    /// a version gap); the others of the batch run again without them. A
    /// message that is not in the batch is ignored; naming none at all fails
    /// the batch as a whole.
    pub fn messages<'m, T: 'm>(
        failed: impl IntoIterator<Item = (&'m Message<T>, HandlerError)>,
    ) -> Self {
        Self {
            failure: BatchFailure::Messages(
                failed
                    .into_iter()
                    .map(|(m, e)| (m.meta.message_id.clone(), e))
                    .collect(),
            ),
        }
    }

    /// One message failed.
    pub fn message<T>(message: &Message<T>, error: HandlerError) -> Self {
        Self::messages([(message, error)])
    }
}

impl<E: Into<HandlerError>> From<E> for BatchError {
    fn from(e: E) -> Self {
        Self::all(e)
    }
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.failure {
            BatchFailure::All(e) => write!(f, "the batch failed: {e}"),
            BatchFailure::Messages(failed) => {
                write!(f, "{} message(s) of the batch failed", failed.len())
            }
        }
    }
}

/// Something that handles batches of messages of payload type `T` inside a
/// transaction of `DB`, with the registry's state `S`.
///
/// Like [`Handler`](super::Handler), never implemented by hand: any
/// `async fn(Batch<T>, &mut Tx<DB>) -> BatchResult` is one, and so is any
/// `async fn(State<S>, Batch<T>, &mut Tx<DB>) -> BatchResult` on a registry
/// with state `S`. Register it with
/// [`Registry::route_batch`](crate::Registry::route_batch).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a batch handler",
    label = "a batch handler goes here",
    note = "a batch handler is `async fn(Batch<T>, &mut Tx<DB>) -> BatchResult`, or \
            `async fn(State<S>, Batch<T>, &mut Tx<DB>) -> BatchResult` on a registry with state; \
            a handler of one message goes to `Registry::route`"
)]
pub trait BatchHandler<'a, T, DB: Database, S, M>: Send + Sync + 'static {
    /// The future the handler returns.
    type Future: Future<Output = BatchResult> + Send + 'a;

    /// Handles a batch. Everything written through `tx` commits together with
    /// the inbox claims of its messages, or not at all.
    fn call(&self, state: &S, batch: Batch<T>, tx: &'a mut Tx<DB>) -> Self::Future;
}

impl<'a, T, DB, S, F, Fut> BatchHandler<'a, T, DB, S, Stateless> for F
where
    DB: Database,
    F: Fn(Batch<T>, &'a mut Tx<DB>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = BatchResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, _state: &S, batch: Batch<T>, tx: &'a mut Tx<DB>) -> Fut {
        self(batch, tx)
    }
}

impl<'a, T, DB, S, F, Fut> BatchHandler<'a, T, DB, S, WithState> for F
where
    DB: Database,
    S: Clone,
    F: Fn(State<S>, Batch<T>, &'a mut Tx<DB>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = BatchResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, state: &S, batch: Batch<T>, tx: &'a mut Tx<DB>) -> Fut {
        self(State(state.clone()), batch, tx)
    }
}

/// A batch route with its payload type erased: takes the bound messages of a
/// unit of work, all of this route, and calls the handler once.
pub(crate) trait ErasedBatch<DB: Database>: Send + Sync {
    /// Calls the handler with `messages`, each a `Message<T>` this route
    /// bound.
    fn call<'a>(
        &self,
        messages: Vec<Box<dyn Any + Send>>,
        tx: &'a mut Tx<DB>,
    ) -> BoxFuture<'a, BatchResult>;
}

/// The route of a batch handler: binds each message's payload, and calls
/// the handler with the messages of a unit.
pub(crate) struct TypedBatch<T, H, S, M> {
    inner: Arc<BatchRoute<T, H, S, M>>,
}

struct BatchRoute<T, H, S, M> {
    handler: H,
    state: S,
    key: Option<KeyFn<T>>,
    _payload: PhantomData<fn() -> (T, M)>,
}

impl<T, H, S, M> TypedBatch<T, H, S, M> {
    pub(crate) fn new(handler: H, state: S, key: Option<KeyFn<T>>) -> Self {
        Self {
            inner: Arc::new(BatchRoute {
                handler,
                state,
                key,
                _payload: PhantomData,
            }),
        }
    }
}

impl<T, H, DB, S, M> ErasedHandler<DB> for TypedBatch<T, H, S, M>
where
    DB: Database,
    T: DeserializeOwned + Send + 'static,
    S: Clone + Send + Sync + 'static,
    M: 'static,
    H: for<'a> BatchHandler<'a, T, DB, S, M>,
{
    fn bind(&self, delivered: Delivered<'_>) -> Result<(Metadata, Call<DB>), Unbound> {
        let message = message_of(delivered, self.inner.key.as_ref())?;
        let meta = message.meta.clone();
        let route: Arc<dyn ErasedBatch<DB>> = self.inner.clone();
        Ok((
            meta,
            Call::Batch {
                route,
                message: Box::new(message),
            },
        ))
    }
}

impl<T, H, DB, S, M> ErasedBatch<DB> for BatchRoute<T, H, S, M>
where
    DB: Database,
    T: Send + 'static,
    S: Clone + Send + Sync + 'static,
    M: 'static,
    H: for<'a> BatchHandler<'a, T, DB, S, M>,
{
    fn call<'a>(
        &self,
        messages: Vec<Box<dyn Any + Send>>,
        tx: &'a mut Tx<DB>,
    ) -> BoxFuture<'a, BatchResult> {
        let messages = messages
            .into_iter()
            .map(|m| {
                *m.downcast::<Message<T>>()
                    .expect("a unit hands a batch route only the messages it bound")
            })
            .collect();
        let future = self.handler.call(&self.state, Batch { messages }, tx);
        Box::pin(future)
    }
}
