//! The handler API: a plain `async fn` that takes the typed message and the open
//! transaction, and says how it went.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use sqlx::Database;

use crate::envelope::Metadata;
use crate::failure::HandlerError;
use crate::store::Tx;

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
}

/// Something that handles messages of payload type `T` inside a transaction of `DB`.
///
/// You do not implement this by hand: any `async fn(Message<T>, &mut Tx<DB>) ->
/// Result<(), HandlerError>` is a handler. The lifetime parameter is how Rust spells
/// "the future may borrow the transaction"; bounds read `for<'a> Handler<'a, T, DB>`.
///
/// Implement it on your own type when the handler needs state (an HTTP client, a
/// configuration), returning a boxed future.
pub trait Handler<'a, T, DB: Database>: Send + Sync + 'static {
    /// The future the handler returns.
    type Future: Future<Output = Result<(), HandlerError>> + Send + 'a;

    /// Handles one message. Everything written through `tx` commits together with
    /// the inbox claim, or not at all.
    fn call(&self, msg: Message<T>, tx: &'a mut Tx<DB>) -> Self::Future;
}

impl<'a, T, DB, F, Fut> Handler<'a, T, DB> for F
where
    DB: Database,
    F: Fn(Message<T>, &'a mut Tx<DB>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, msg: Message<T>, tx: &'a mut Tx<DB>) -> Fut {
        self(msg, tx)
    }
}

/// A handler with its payload type erased, so handlers of different types can share
/// one routing table.
pub(crate) trait ErasedHandler<DB: Database>: Send + Sync {
    /// Deserializes the payload and binds it to the handler. Failing here means the
    /// payload does not match the registered type: a permanent failure found before
    /// any transaction is opened.
    fn bind(
        &self,
        payload: &RawValue,
        meta: Metadata,
        redelivered: bool,
        attempt: u32,
    ) -> Result<Box<dyn BoundCall<DB>>, serde_json::Error>;
}

/// A handler call with its message, waiting for a transaction.
pub(crate) trait BoundCall<DB: Database>: Send {
    fn call<'a>(self: Box<Self>, tx: &'a mut Tx<DB>) -> BoxFuture<'a, Result<(), HandlerError>>;
}

pub(crate) struct Typed<T, H> {
    handler: Arc<H>,
    _payload: PhantomData<fn() -> T>,
}

impl<T, H> Typed<T, H> {
    pub(crate) fn new(handler: H) -> Self {
        Self {
            handler: Arc::new(handler),
            _payload: PhantomData,
        }
    }
}

struct Bound<T, H> {
    handler: Arc<H>,
    msg: Message<T>,
}

impl<T, H, DB> ErasedHandler<DB> for Typed<T, H>
where
    DB: Database,
    T: DeserializeOwned + Send + 'static,
    H: for<'a> Handler<'a, T, DB>,
{
    fn bind(
        &self,
        payload: &RawValue,
        meta: Metadata,
        redelivered: bool,
        attempt: u32,
    ) -> Result<Box<dyn BoundCall<DB>>, serde_json::Error> {
        let payload: T = serde_json::from_str(payload.get())?;
        Ok(Box::new(Bound {
            handler: Arc::clone(&self.handler),
            msg: Message {
                payload,
                meta,
                redelivered,
                attempt,
            },
        }))
    }
}

impl<T, H, DB> BoundCall<DB> for Bound<T, H>
where
    DB: Database,
    T: Send + 'static,
    H: for<'a> Handler<'a, T, DB>,
{
    fn call<'a>(self: Box<Self>, tx: &'a mut Tx<DB>) -> BoxFuture<'a, Result<(), HandlerError>> {
        let Bound { handler, msg } = *self;
        Box::pin(async move { handler.call(msg, tx).await })
    }
}
