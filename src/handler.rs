//! The handler API: a plain `async fn` that takes the typed message and the open
//! transaction, and says how it went; or, for set-based writes, one that takes
//! every new message of its route in the transaction ([`Batch`]).

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use sqlx::Database;

pub use crate::failure::BoxError;
pub use crate::idempotency::idempotency_key;
pub use batch::{Batch, BatchError, BatchHandler, BatchResult};

mod batch;
pub(crate) use batch::{BatchFailure, ErasedBatch, TypedBatch};

use crate::envelope::{InvalidMessage, Metadata};
use crate::failure::{DeadLetterReason, HandlerError};
use crate::format::{Identity, Read, check_id};
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

/// A key a route derives from its typed payload, for messages sent without
/// an id (see [`Registry::route_keyed`](crate::Registry::route_keyed)).
pub(crate) type KeyFn<T> = Arc<dyn Fn(&T) -> String + Send + Sync>;

/// A delivery as a route binds it: what its format read, and what the
/// broker and warren's history say.
pub(crate) struct Delivered<'a> {
    pub(crate) read: &'a Read,
    pub(crate) redelivered: bool,
    pub(crate) attempt: u32,
    pub(crate) partition_key: Option<String>,
}

/// Why a delivery does not bind to its route: each a dead letter.
#[derive(Debug)]
pub(crate) enum Unbound {
    /// The payload does not deserialize into the route's type.
    Payload(serde_json::Error),
    /// No id was sent and the route derives none.
    NoId,
    /// The derived key breaks the id rules.
    Key(InvalidMessage),
}

impl Unbound {
    /// The dead letter, for a delivery of `read`.
    pub(crate) fn refusal(self, read: &Read) -> InvalidMessage {
        match self {
            Unbound::Payload(e) => InvalidMessage::new(
                DeadLetterReason::InvalidPayload,
                format!(
                    "payload does not match {} v{}: {e}",
                    read.event_type, read.schema_version
                ),
            ),
            Unbound::NoId => InvalidMessage::new(
                DeadLetterReason::MissingMessageId,
                format!(
                    "the message has no id (the AMQP message_id property is missing or empty) and the route {} v{} derives none",
                    read.event_type, read.schema_version
                ),
            ),
            Unbound::Key(why) => why,
        }
    }
}

/// The typed message of a delivery: its payload deserialized, its identity
/// the producer's or, when it sent none, the key its route derives.
pub(crate) fn message_of<T: DeserializeOwned>(
    d: Delivered<'_>,
    key: Option<&KeyFn<T>>,
) -> Result<Message<T>, Unbound> {
    let payload: T = serde_json::from_str(d.read.payload.get()).map_err(Unbound::Payload)?;
    let identity = match (&d.read.identity, key) {
        (Some(identity), _) => identity.clone(),
        (None, Some(derive)) => {
            let key = derive(&payload);
            check_id("the derived key", &key, DeadLetterReason::InvalidDerivedKey)
                .map_err(Unbound::Key)?;
            Identity::Derived(key)
        }
        (None, None) => return Err(Unbound::NoId),
    };
    Ok(Message {
        payload,
        meta: d.read.meta(identity),
        redelivered: d.redelivered,
        attempt: d.attempt,
        partition_key: d.partition_key,
    })
}

/// A handler with its payload type erased, so handlers of different types can share
/// one routing table.
pub(crate) trait ErasedHandler<DB: Database>: Send + Sync {
    /// Deserializes the payload, settles the message's identity and binds
    /// it to the handler. Failing here is a permanent failure found before
    /// any transaction is opened.
    fn bind(&self, delivered: Delivered<'_>) -> Result<(Metadata, Call<DB>), Unbound>;
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
    key: Option<KeyFn<T>>,
    _payload: PhantomData<fn() -> (T, M)>,
}

impl<T, H, S, M> Typed<T, H, S, M> {
    pub(crate) fn new(handler: H, state: S, key: Option<KeyFn<T>>) -> Self {
        Self {
            handler: Arc::new(handler),
            state,
            key,
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
    fn bind(&self, delivered: Delivered<'_>) -> Result<(Metadata, Call<DB>), Unbound> {
        let msg = message_of(delivered, self.key.as_ref())?;
        let meta = msg.meta.clone();
        Ok((
            meta,
            Call::One(Box::new(Bound {
                handler: Arc::clone(&self.handler),
                state: self.state.clone(),
                msg,
                _shape: PhantomData::<fn() -> M>,
            })),
        ))
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
