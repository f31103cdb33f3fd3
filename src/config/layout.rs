//! The broker topology a consumer's configuration implies.

use super::ConsumerConfig;
use crate::partition::partition_queue_name;
use crate::topology::{QueueLayout, Topology};

impl ConsumerConfig {
    /// The queue-level facts the topology is derived from.
    pub fn layout(&self) -> QueueLayout {
        QueueLayout {
            queue: self.queue.clone(),
            exchange: self.exchange.clone(),
            binding_keys: self.binding_keys.clone(),
            queue_type: self.queue_type,
            tiers: self.retry.tiers().to_vec(),
            delivery_limit: backstop_delivery_limit(self.prefetch, self.retry.poison_limit()),
            outgoing: self.outgoing.clone(),
            stand_ins: self.stand_ins.clone(),
            single_active_consumer: self.single_active_consumer,
        }
    }
}

/// The broker's delivery limit on a quorum main queue: the far backstop for a
/// process that dies before it can record a solo run. Every message a dying
/// process held gains a delivery, and a message can wait behind a poison one
/// through all of its solo runs, so the limit grows with the prefetch window
/// times the poison limit, never below 20.
fn backstop_delivery_limit(prefetch: u16, poison_limit: u32) -> i64 {
    (i64::from(prefetch) * (i64::from(poison_limit) + 1)).max(20)
}

impl Topology {
    /// The topology of one consumer: [`Topology::for_queue`] of its
    /// [`layout`](ConsumerConfig::layout).
    ///
    /// A partitioned consumer's topology holds its exchanges, every partition's
    /// queues (main with single active consumer, tiers, dead-letter queue), the
    /// stand-ins, and the [`Ring`](crate::topology::Ring) that binds them.
    pub fn for_consumer(config: &ConsumerConfig) -> Self {
        let Some(partitions) = &config.partitions else {
            return Topology::for_queue(&config.layout());
        };
        let mut layout = config.layout();
        layout.exchange = None;
        layout.binding_keys = Vec::new();
        let shared = Topology::for_queue(&QueueLayout {
            queue: String::new(),
            tiers: Vec::new(),
            ..layout
        });
        let mut topology = Topology {
            exchanges: shared.exchanges,
            queues: shared
                .queues
                .into_iter()
                .filter(|q| config.stand_ins.iter().any(|s| s.queue == q.name))
                .collect(),
            bindings: shared.bindings,
            ring: None,
        };
        if let Some(source) = &config.exchange
            && !topology.exchanges.iter().any(|e| &e.name == source)
        {
            topology.exchanges.insert(
                0,
                crate::topology::ExchangeSpec {
                    name: source.clone(),
                    kind: crate::topology::ExchangeKind::Topic,
                },
            );
        }
        for index in 0..partitions.count {
            let part = config.for_partition(index).layout();
            topology.queues.extend(Topology::for_queue(&part).queues);
        }
        topology.ring = Some(crate::topology::Ring {
            exchange: partitions.exchange.clone(),
            header: partitions.header.clone(),
            queues: config.partition_queues(),
            next_queue: partition_queue_name(&config.queue, partitions.count),
            source: config
                .exchange
                .clone()
                .map(|e| (e, config.binding_keys.clone())),
        });
        topology
    }
}
