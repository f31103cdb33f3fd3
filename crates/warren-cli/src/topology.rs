//! `warren topology`: what a consumer declares, shown or declared.

use warren::topology::Topology;

pub(crate) fn print_topology(t: &Topology) {
    for e in &t.exchanges {
        println!("exchange {} ({:?}, durable)", e.name, e.kind);
    }
    for q in &t.queues {
        let args: Vec<String> = q
            .arguments
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!("queue    {} (durable) {}", q.name, args.join(" "));
    }
    for b in &t.bindings {
        println!("binding  {} -> {} [{}]", b.exchange, b.queue, b.routing_key);
    }
}
