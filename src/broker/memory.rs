//! An in-memory [`Port`]: records acks, returns and published copies, and can be
//! told to refuse publishes to a queue, so that every disposition of the
//! pipeline is tested in milliseconds without a broker.

use std::collections::HashSet;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use lapin::BasicProperties;

use super::BrokerError;
use super::port::Port;

/// A copy the pipeline published.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    pub(crate) queue: String,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: BasicProperties,
}

#[derive(Debug, Default)]
struct State {
    acked: Vec<(u64, bool)>,
    requeued: Vec<u64>,
    published: Vec<Published>,
    refusing: HashSet<String>,
}

/// The double. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub(crate) struct MemoryBroker {
    state: Mutex<State>,
}

// The kit (feature `testing`) reads only the copies; the pipeline's own tests
// use the rest.
#[cfg_attr(not(test), allow(dead_code))]
impl MemoryBroker {
    /// Publishes to `queue` fail from now on, as if it had been deleted.
    pub(crate) fn refuse(&self, queue: &str) {
        self.state.lock().unwrap().refusing.insert(queue.to_owned());
    }

    /// Tags acked, with their `multiple` flag, in order.
    pub(crate) fn acked(&self) -> Vec<(u64, bool)> {
        self.state.lock().unwrap().acked.clone()
    }

    /// Tags handed back for redelivery.
    pub(crate) fn requeued(&self) -> Vec<u64> {
        self.state.lock().unwrap().requeued.clone()
    }

    /// Copies published, in order.
    pub(crate) fn published(&self) -> Vec<Published> {
        self.state.lock().unwrap().published.clone()
    }
}

impl Port for MemoryBroker {
    fn ack(&self, tag: u64) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.state.lock().unwrap().acked.push((tag, false));
        Box::pin(async { Ok(()) })
    }

    /// Acks a committed batch with one `multiple` ack of its highest tag, as a
    /// channel with nothing else open would.
    fn ack_all<'a>(&'a self, tags: &'a [u64]) -> BoxFuture<'a, Result<(), BrokerError>> {
        if let Some(&top) = tags.iter().max() {
            self.state.lock().unwrap().acked.push((top, tags.len() > 1));
        }
        Box::pin(async { Ok(()) })
    }

    fn requeue(&self, tag: u64) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.state.lock().unwrap().requeued.push(tag);
        Box::pin(async { Ok(()) })
    }

    fn publish<'a>(
        &'a self,
        queue: &'a str,
        body: &'a [u8],
        properties: BasicProperties,
    ) -> BoxFuture<'a, Result<(), BrokerError>> {
        let mut state = self.state.lock().unwrap();
        let result = if state.refusing.contains(queue) {
            Err(BrokerError::Unavailable(format!(
                "{queue} refuses publishes"
            )))
        } else {
            state.published.push(Published {
                queue: queue.to_owned(),
                body: body.to_vec(),
                properties,
            });
            Ok(())
        };
        Box::pin(async move { result })
    }

    fn frame_max(&self) -> usize {
        crate::headers::DEFAULT_FRAME_MAX
    }
}
