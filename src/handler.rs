//! The handler API: a plain `async fn` that takes the typed message and the open
//! transaction, and says how it went; or, for set-based writes, one that takes
//! every new message of its route in the transaction ([`Batch`]).

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use sqlx::Database;

pub use crate::failure::BoxError;
pub use crate::idempotency::idempotency_key;
pub use batch::{Batch, BatchError, BatchHandler, BatchResult};

mod batch;
pub(crate) use batch::{BatchFailure, ErasedBatch, TypedBatch};

use crate::envelope::Metadata;
use crate::failure::HandlerError;
use crate::message::{Message, State};
use crate::store::tx::Tx;

/// Marks handlers that take no state: `async fn(Message<T>, &mut Tx<DB>)`.
#[derive(Debug)]
pub enum Stateless {}

/// Marks handlers that take the registry's state first:
/// `async fn(State<S>, Message<T>, &mut Tx<DB>)`.
#[derive(Debug)]
pub enum WithState {}

/// Something that handles messages of payload type `T` inside a transaction of
/// `DB`, with the registry's state `S`.
///
/// You do not implement this by hand: any `async fn(Message<T>, &mut Tx<DB>) ->
/// Result<(), HandlerError>` is a handler, and so is any
/// `async fn(State<S>, Message<T>, &mut Tx<DB>)` on a registry with state `S`.
/// The lifetime parameter is how Rust spells "the future may borrow the
/// transaction"; `M` tells the two shapes apart and is always inferred.
pub trait Handler<'a, T, DB: Database, S, M>: Send + Sync + 'static {
    /// The future the handler returns.
    type Future: Future<Output = Result<(), HandlerError>> + Send + 'a;

    /// Handles one message. Everything written through `tx` commits together with
    /// the inbox claim, or not at all.
    fn call(&self, state: &S, msg: Message<T>, tx: &'a mut Tx<DB>) -> Self::Future;
}

impl<'a, T, DB, S, F, Fut> Handler<'a, T, DB, S, Stateless> for F
where
    DB: Database,
    F: Fn(Message<T>, &'a mut Tx<DB>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, _state: &S, msg: Message<T>, tx: &'a mut Tx<DB>) -> Fut {
        self(msg, tx)
    }
}

impl<'a, T, DB, S, F, Fut> Handler<'a, T, DB, S, WithState> for F
where
    DB: Database,
    S: Clone,
    F: Fn(State<S>, Message<T>, &'a mut Tx<DB>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, state: &S, msg: Message<T>, tx: &'a mut Tx<DB>) -> Fut {
        self(State(state.clone()), msg, tx)
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
        partition_key: Option<String>,
    ) -> Result<Call<DB>, serde_json::Error>;
}

/// A message bound to its route, waiting for a transaction.
pub(crate) enum Call<DB: Database> {
    /// For a handler of one message: the call itself.
    One(Box<dyn BoundCall<DB>>),
    /// For a batch handler: the typed message, handed over with the others
    /// of its route in the unit of work.
    Batch {
        route: Arc<dyn ErasedBatch<DB>>,
        message: Box<dyn std::any::Any + Send>,
    },
}

/// A handler call with its message, waiting for a transaction.
pub(crate) trait BoundCall<DB: Database>: Send {
    fn call<'a>(self: Box<Self>, tx: &'a mut Tx<DB>) -> BoxFuture<'a, Result<(), HandlerError>>;
}

pub(crate) struct Typed<T, H, S, M> {
    handler: Arc<H>,
    state: S,
    _payload: PhantomData<fn() -> (T, M)>,
}

impl<T, H, S, M> Typed<T, H, S, M> {
    pub(crate) fn new(handler: H, state: S) -> Self {
        Self {
            handler: Arc::new(handler),
            state,
            _payload: PhantomData,
        }
    }
}

struct Bound<T, H, S, M> {
    handler: Arc<H>,
    state: S,
    msg: Message<T>,
    _shape: PhantomData<fn() -> M>,
}

impl<T, H, DB, S, M> ErasedHandler<DB> for Typed<T, H, S, M>
where
    DB: Database,
    T: DeserializeOwned + Send + 'static,
    S: Clone + Send + Sync + 'static,
    M: 'static,
    H: for<'a> Handler<'a, T, DB, S, M>,
{
    fn bind(
        &self,
        payload: &RawValue,
        meta: Metadata,
        redelivered: bool,
        attempt: u32,
        partition_key: Option<String>,
    ) -> Result<Call<DB>, serde_json::Error> {
        let payload: T = serde_json::from_str(payload.get())?;
        Ok(Call::One(Box::new(Bound {
            handler: Arc::clone(&self.handler),
            state: self.state.clone(),
            msg: Message {
                payload,
                meta,
                redelivered,
                attempt,
                partition_key,
            },
            _shape: PhantomData::<fn() -> M>,
        })))
    }
}

impl<T, H, DB, S, M> BoundCall<DB> for Bound<T, H, S, M>
where
    DB: Database,
    T: Send + 'static,
    S: Send + Sync + 'static,
    M: 'static,
    H: for<'a> Handler<'a, T, DB, S, M>,
{
    fn call<'a>(self: Box<Self>, tx: &'a mut Tx<DB>) -> BoxFuture<'a, Result<(), HandlerError>> {
        let Bound {
            handler,
            state,
            msg,
            ..
        } = *self;
        Box::pin(async move { handler.call(&state, msg, tx).await })
    }
}
