//! Row 8: what reading each format billing accepts costs warren's process,
//! per message, against warren's envelope. The same consumer (billing's
//! formats, in billing's order) drains a queue of invoices in one format at
//! a time, every format once a round, five rounds: the median of each
//! format's five. Beside it, in this process over the same messages: the
//! read alone (`Formats::read`), the only step of warren's the formats do not
//! share; and the AMQP client's parse of each message's properties alone
//! (amq-protocol's `parse_frame`, which lapin runs on every frame), which
//! grows with every header a format carries.

use std::path::Path;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use std::time::Instant;

use warren::config::BatchIsolation;
use warren::format::{DEFAULT_MAX_BODY_BYTES, Incoming};

use super::dbs::BenchDb;
use super::measured;
use super::profile::profiled;
use super::workloads::{self, Env, invoices_in};
use billing_service::service::invoice_formats;
use billing_service::stream::{Form, Planned};

/// Rounds; each runs every format once, in turn (each round from another
/// format), so that what drifts over a run (the inbox growing, the
/// machine's other load) falls on all alike.
const ROUNDS: usize = 5;

/// What a format may cost warren's process over the envelope, per message.
pub(crate) const BUDGET_US: f64 = 2.0;

/// The formats measured, the envelope first: the baseline.
const FORMS: [Form; 4] = [
    Form::Warren,
    Form::Bare,
    Form::CloudEventBinary,
    Form::CloudEventStructured,
];

/// Passes over the messages for the read alone: enough to take it out of
/// the clock's noise.
const READ_PASSES: usize = 20;

/// One format's figures, a value a round.
pub(crate) struct FormatCost {
    pub form: Form,
    /// warren's process CPU per message of a drain, in µs.
    pub drains: Vec<f64>,
    /// The read alone, in µs per message.
    pub reads: Vec<f64>,
    /// The client's parse of the content header alone, in µs per message.
    pub parses: Vec<f64>,
}

impl FormatCost {
    pub(crate) fn drain(&self) -> f64 {
        median(&self.drains)
    }

    pub(crate) fn read(&self) -> f64 {
        median(&self.reads)
    }

    pub(crate) fn parse(&self) -> f64 {
        median(&self.parses)
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Runs row 8 over `n` messages a drain, on queues `queue` names.
pub(crate) async fn row8<B: BenchDb>(
    env: &Env,
    store: &B::S,
    queue: &dyn Fn(&str) -> String,
    n: usize,
    profile: Option<&Path>,
) -> Result<Vec<FormatCost>, String> {
    let mut costs: Vec<FormatCost> = FORMS
        .iter()
        .map(|&form| FormatCost {
            form,
            drains: Vec::new(),
            reads: Vec::new(),
            parses: Vec::new(),
        })
        .collect();
    for round in 0..ROUNDS {
        // Each round starts at another format: none always runs first, or
        // always right after another.
        let formats = costs.len();
        for k in 0..formats {
            let i = (k + round) % formats;
            let cost = &mut costs[i];
            // Fresh ids each drain: the consumer's inbox holds the others.
            let messages = invoices_in(cost.form, n);
            cost.reads.push(read_alone(&messages)?);
            cost.parses.push(client_parse(&messages)?);
            let q = queue(&format!("format{i}-{round}"));
            let t = workloads::filled_queue(env, &q, &messages).await?;
            // The last round's drains are profiled (with --profile): one
            // flamegraph a format, to set side by side.
            let dir = profile.filter(|_| round + 1 == ROUNDS);
            let name = format!("row8-{}-{}", B::LABEL, cost.form.slug());
            let run = profiled(
                dir,
                &name,
                measured(
                    n,
                    workloads::warren_one_insert::<B>(
                        env,
                        store.clone(),
                        &q,
                        n,
                        false,
                        &|b| {
                            b.with_batch_isolation(BatchIsolation::Replay)
                                .with_formats(invoice_formats())
                        },
                        &|| {},
                    ),
                ),
            )
            .await?;
            let _ = warren::broker::delete(&env.connection, &t).await;
            let (_, stats) = run.out?;
            if stats.applied != n as u64 {
                return Err(format!(
                    "row 8, {}: {} of {n} applied ({stats:?})",
                    cost.form.name(),
                    stats.applied
                ));
            }
            cost.drains.push(run.cpu.this);
        }
    }
    Ok(costs)
}

/// `Formats::read` over `messages` with billing's formats, in µs per
/// message (wall time on one thread, which nothing else holds meanwhile).
fn read_alone(messages: &[Planned]) -> Result<f64, String> {
    let formats = invoice_formats();
    let started = Instant::now();
    for _ in 0..READ_PASSES {
        for m in messages {
            let incoming = Incoming::new(&m.properties, &m.routing_key, &m.body);
            let read = formats
                .read(&incoming, DEFAULT_MAX_BODY_BYTES)
                .map_err(|e| {
                    format!("row 8: billing's formats refused a benchmark message: {e}")
                })?;
            std::hint::black_box(read);
        }
    }
    let per = started.elapsed().as_secs_f64() * 1e6 / (READ_PASSES * messages.len().max(1)) as f64;
    Ok(per)
}

/// The AMQP client's parse of each message's content header frame (its
/// properties, headers included), in µs per message: amq-protocol's
/// `parse_frame`, the parser lapin runs on what the broker sends, over the
/// frames these messages arrive in. Wall time on one thread, as the read's.
fn client_parse(messages: &[Planned]) -> Result<f64, String> {
    let frames = messages
        .iter()
        .map(|m| {
            let frame = AMQPFrame::Header(
                1,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: m.body.len() as u64,
                    properties: m.properties.clone(),
                },
            );
            gen_frame(&frame)(WriteContext::from(Vec::new()))
                .map(|written| written.write)
                .map_err(|e| format!("row 8: cannot write a content header frame: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    for _ in 0..READ_PASSES {
        for frame in &frames {
            let parsed = parse_frame(frame.as_slice())
                .map_err(|e| format!("row 8: the client cannot parse a frame: {e:?}"))?;
            std::hint::black_box(parsed);
        }
    }
    let per = started.elapsed().as_secs_f64() * 1e6 / (READ_PASSES * frames.len().max(1)) as f64;
    Ok(per)
}

/// Prints row 8's table; true if every format is within the budget.
pub(crate) fn print(label: &str, costs: &[FormatCost]) -> bool {
    let Some(envelope) = costs.first() else {
        return true;
    };
    println!(
        "{label}: row 8, warren's process CPU per message by format (median of {ROUNDS} \
         drains each, taken in turns; budget: {BUDGET_US} µs over the envelope)"
    );
    println!(
        "   {:<24} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}   runs (µs/msg)",
        "format",
        "drain µs",
        "over env",
        "read µs",
        "over env",
        "client µs",
        "over env",
        "warren's"
    );
    let mut within = true;
    for c in costs {
        let over = c.drain() - envelope.drain();
        let verdict = if std::ptr::eq(c, envelope) {
            ""
        } else if over <= BUDGET_US {
            " met"
        } else {
            within = false;
            " MISSED"
        };
        let runs: Vec<String> = c.drains.iter().map(|d| format!("{d:.1}")).collect();
        // What the format costs over the envelope once the client's parse
        // of its properties is taken out: warren's own share.
        let client_over = c.parse() - envelope.parse();
        println!(
            "   {:<24} {:>9.1} {:>+9.2} {:>9.2} {:>+9.2} {:>9.2} {:>+9.2} {:>+9.2}   {}{verdict}",
            c.form.name(),
            c.drain(),
            over,
            c.read(),
            c.read() - envelope.read(),
            c.parse(),
            client_over,
            over - client_over,
            runs.join(" "),
        );
    }
    within
}
