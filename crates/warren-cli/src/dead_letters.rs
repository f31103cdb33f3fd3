//! `warren dead-letters`: the dead letters kept in a database. Reads need
//! only the database; replays also the broker; every change needs
//! `--operator` and is written to the audit table.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use warren::store::{
    Actor, DeadLetterGroup, DeadLetterStore, GroupMute, Journal, JournalEntry, LetterFilter,
    LetterState, PageAfter, SigningKey, StoredDeadLetter,
};
use warren_admin::{
    CopyOutcome, Ingester, ReplayError, Replayer, edit_letter, printable, printable_json,
    purge_letters, replays_with_outcomes, set_payload_fields,
};

use crate::CliError;
use crate::cli::{DeadLettersCommand, ReplayWhich};
use crate::print::{id, one_line};

/// What a dead-letters command needs besides the store: the broker, for
/// the commands that publish or consume.
pub(crate) struct Broker {
    pub(crate) amqp_url: String,
    pub(crate) tls: warren::tls::TlsOptions,
}

pub(crate) async fn run_dead_letters<S>(
    store: &S,
    operator: Option<String>,
    command: DeadLettersCommand,
    broker: &Broker,
) -> Result<(), CliError>
where
    S: DeadLetterStore + SigningKey + Journal,
{
    let actor = || {
        match &operator {
        Some(name) if !name.trim().is_empty() => Ok(Actor::new(name.trim())),
        _ => Err(CliError::Usage(
            "this command changes stored letters: say who you are with --operator NAME (or WARREN_OPERATOR)"
                .into(),
        )),
    }
    };
    let fail = |e: warren::store::StoreError| CliError::Failed(e.to_string());
    match command {
        DeadLettersCommand::Groups {
            filter,
            limit,
            json,
        } => {
            let groups = store
                .dead_letter_groups(&filter.filter(), limit)
                .await
                .map_err(fail)?;
            let mutes = store.group_mutes().await.map_err(fail)?;
            print_groups(&groups, &mutes, json);
        }
        DeadLettersCommand::List {
            filter,
            limit,
            after,
            json,
        } => {
            let letters = store
                .dead_letters(&filter.filter(), after.as_ref(), limit)
                .await
                .map_err(fail)?;
            print_list(&letters, limit, json);
        }
        DeadLettersCommand::Show {
            letter,
            show_payload,
            json,
        } => show(store, &letter, show_payload, json).await?,
        DeadLettersCommand::Replay {
            which,
            careful,
            outcome_timeout,
            rate,
            inbox_retention,
            force,
            no_wait,
        } => {
            let actor = actor()?;
            let connection = warren::broker::connect_with_tls(
                &broker.amqp_url,
                "warren dead-letters replay",
                &broker.tls,
            )
            .await
            .map(Arc::new)
            .map_err(|e| CliError::Failed(format!("cannot connect to the broker: {e}")))?;
            let mut replayer = Replayer::new(store.clone(), Arc::clone(&connection), actor);
            if let Some(r) = rate {
                replayer = replayer.with_rate(r).map_err(CliError::Usage)?;
            }
            if careful {
                replayer = replayer.careful(outcome_timeout);
            }
            let done = replay(
                store,
                &replayer,
                which,
                inbox_retention,
                force,
                (!no_wait).then_some(outcome_timeout),
            )
            .await;
            warren::broker::close_connection(&connection, "done").await;
            done?;
        }
        DeadLettersCommand::Edit {
            letter,
            sets,
            reason,
        } => {
            let actor = actor()?;
            let record = store
                .dead_letter(&letter)
                .await
                .map_err(fail)?
                .ok_or_else(|| CliError::Failed(format!("no dead letter {letter:?}")))?;
            let body = if sets.is_empty() {
                edit_in_editor(record.body_to_send())?
            } else {
                set_payload_fields(&record, &sets).map_err(CliError::Failed)?
            };
            edit_letter(store, &letter, &body, &reason, &actor)
                .await
                .map_err(|e| CliError::Failed(printable(&e.to_string()).into_owned()))?;
            println!(
                "edited {letter}; the original is kept. Replay it with: warren dead-letters replay --id {letter}"
            );
        }
        DeadLettersCommand::Resolve { which } => {
            let n = store
                .resolve_dead_letters(&which.filter(), &actor()?)
                .await
                .map_err(fail)?;
            if n == 0 && which.id.is_some() {
                return Err(CliError::Failed(format!(
                    "no unresolved dead letter {:?}",
                    which.id.unwrap_or_default()
                )));
            }
            println!("resolved {n} letter(s)");
        }
        DeadLettersCommand::Reclassify { which, to } => {
            let n = store
                .reclassify_dead_letters(&which.filter(), &to, &actor()?)
                .await
                .map_err(fail)?;
            if n == 0 {
                return Err(CliError::Failed("no unresolved letter matches".into()));
            }
            println!("moved {n} letter(s) to group {to}");
        }
        DeadLettersCommand::Mute {
            group,
            for_,
            grows_by,
            reason,
        } => {
            if for_.is_none() && grows_by.is_none() {
                return Err(CliError::Usage(
                    "a mute ends: give --for DURATION, --grows-by N, or both".into(),
                ));
            }
            let until = match for_ {
                Some(d) => Some(
                    chrono::Duration::from_std(d)
                        .ok()
                        .and_then(|d| Utc::now().checked_add_signed(d))
                        .ok_or_else(|| CliError::Usage(format!("--for {d:?} is too long")))?,
                ),
                None => None,
            };
            let mute = store
                .mute_group(&group, until, grows_by, &reason, &actor()?)
                .await
                .map_err(fail)?;
            println!(
                "muted group {} ({} letters now) {}",
                printable(&group),
                mute.count_at_mute,
                mute_text(&mute)
            );
        }
        DeadLettersCommand::Unmute { group } => {
            if !store.unmute_group(&group, &actor()?).await.map_err(fail)? {
                return Err(CliError::Failed(format!(
                    "group {} is not muted",
                    printable(&group)
                )));
            }
            println!("unmuted group {}", printable(&group));
        }
        DeadLettersCommand::Purge {
            older_than,
            include_unresolved,
            force,
            yes,
        } => {
            if !yes {
                return Err(CliError::Usage(
                    "purging deletes stored letters for good; add --yes to confirm".into(),
                ));
            }
            let actor = actor()?;
            let cutoff = chrono::Duration::from_std(older_than)
                .ok()
                .and_then(|d| Utc::now().checked_sub_signed(d))
                .ok_or_else(|| CliError::Usage("--older-than is longer than any date".into()))?;
            let mut states = vec![LetterState::Resolved, LetterState::Replayed];
            if include_unresolved && force {
                states.push(LetterState::Unresolved);
            }
            let mut counts = Vec::new();
            for state in states {
                let n = purge_letters(store, state, cutoff).await.map_err(fail)?;
                counts.push(format!("{n} {}", state.as_str()));
            }
            let detail = counts.join(", ");
            store
                .audit(
                    &actor,
                    "purge",
                    &format!("older than {}", warren::retry::format_delay(older_than)),
                    &detail,
                    include_unresolved,
                )
                .await
                .map_err(fail)?;
            println!("purged {detail}");
        }
        DeadLettersCommand::Ingest {
            queue,
            consumer,
            queue_type,
            redact,
            retention,
        } => {
            let config =
                warren::ConsumerConfig::builder(consumer.as_deref().unwrap_or(&queue), &queue)
                    .with_queue_type(queue_type)
                    .with_tls(broker.tls.clone())
                    .build()
                    .map_err(|e| CliError::Usage(e.to_string()))?;
            eprintln!(
                "warren: moving the dead letters of {} into the database until stopped (Ctrl-C)",
                printable(&queue)
            );
            Ingester::new(store.clone(), &config)
                .redacting(redact)
                .with_retention(Some(retention))
                .run(&broker.amqp_url, warren::shutdown_signal())
                .await
                .map_err(|e| CliError::Failed(e.to_string()))?;
        }
        DeadLettersCommand::Audit { limit } => {
            let lines = store.audit_log(limit).await.map_err(fail)?;
            println!(
                "{:<19} {:<16} {:<12} {:<10} {:<6} {:<34} DETAIL",
                "AT", "OPERATOR", "OS USER", "ACTION", "FORCED", "TARGET"
            );
            for a in &lines {
                println!(
                    "{:<19} {:<16} {:<12} {:<10} {:<6} {:<34} {}",
                    time(a.at),
                    one_line(&a.operator, 16),
                    one_line(&a.os_user, 12),
                    one_line(&a.action, 10),
                    if a.forced { "yes" } else { "" },
                    one_line(&a.target, 34),
                    one_line(&a.detail, 100)
                );
            }
        }
        DeadLettersCommand::Policy { edit } => {
            store.allow_edits(edit, &actor()?).await.map_err(fail)?;
            println!(
                "editing dead letters is now {} for every process on this database",
                if edit { "allowed" } else { "switched off" }
            );
        }
    }
    Ok(())
}

async fn replay<S>(
    store: &S,
    replayer: &Replayer<S>,
    which: ReplayWhich,
    inbox_retention: Duration,
    force: bool,
    wait: Option<Duration>,
) -> Result<(), CliError>
where
    S: DeadLetterStore + SigningKey + Journal,
{
    // Replay errors can quote a handler's error text, which can quote a
    // payload: escaped like everything else from a message.
    let failed = |e: ReplayError| CliError::Failed(printable(&e.to_string()).into_owned());
    let (run_id, single) = match (&which.id, &which.group, &which.resume) {
        (Some(letter), _, _) => {
            let record = store
                .dead_letter(letter)
                .await
                .map_err(|e| CliError::Failed(e.to_string()))?
                .ok_or_else(|| CliError::Failed(format!("no dead letter {letter:?}")))?;
            let filter = LetterFilter::of_letter(&record.letter);
            let run = replayer
                .start(&filter, Some(inbox_retention), force)
                .await
                .map_err(failed)?;
            (run.run_id, Some(record.letter))
        }
        (_, Some(group), _) => {
            let filter = LetterFilter::of_group(group);
            let run = replayer
                .start(&filter, Some(inbox_retention), force)
                .await
                .map_err(failed)?;
            println!(
                "replay run {} of {} letter(s) from group {} (resume it with --resume {})",
                run.run_id,
                run.total,
                printable(group),
                run.run_id
            );
            (run.run_id, None)
        }
        (_, _, Some(run_id)) => (run_id.clone(), None),
        _ => return Err(CliError::Usage("give --id, --group or --resume".into())),
    };
    let mut sent = 0u64;
    let resumed = tokio::select! {
        r = replayer.resume(&run_id, |_| {
            sent += 1;
            if sent.is_multiple_of(1000) {
                eprintln!("warren: {sent} replayed");
            }
        }) => r,
        () = warren::shutdown_signal() => {
            return Err(CliError::Failed(format!(
                "interrupted; nothing is lost: resume with --resume {run_id}"
            )));
        }
    };
    let run = resumed.map_err(|e| {
        CliError::Failed(format!(
            "{e} (the run is {run_id}; --resume {run_id} goes on)"
        ))
    })?;
    println!(
        "replayed {} of {} letter(s) in run {} ({})",
        run.published, run.total, run.run_id, run.state
    );
    if let (Some(letter), Some(timeout)) = (single, wait) {
        let replay_id = format!("{run_id}.1");
        match replayer.outcome_of(&replay_id, timeout).await {
            Ok(CopyOutcome::Applied) => println!("outcome: applied"),
            Ok(CopyOutcome::Stale) => println!(
                "outcome: stale: a newer version of its entity had applied; nothing was applied"
            ),
            Ok(CopyOutcome::Duplicate) => println!(
                "outcome: DUPLICATE: the inbox already held message id {}, so nothing was applied{}",
                id(&letter.message_id),
                if store
                    .dead_letter(&letter.letter_id)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|r| r.edit.is_some())
                {
                    " (the edit changed nothing)"
                } else {
                    ""
                }
            ),
            Err(e) => {
                return Err(CliError::Failed(format!(
                    "outcome: {}",
                    printable(&e.to_string())
                )));
            }
        }
    }
    Ok(())
}

async fn show<S: DeadLetterStore + Journal>(
    store: &S,
    letter: &str,
    show_payload: bool,
    json: bool,
) -> Result<(), CliError> {
    let fail = |e: warren::store::StoreError| CliError::Failed(e.to_string());
    let record = store
        .dead_letter(letter)
        .await
        .map_err(fail)?
        .ok_or_else(|| CliError::Failed(format!("no dead letter {letter:?}")))?;
    let (replays, outcomes): (Vec<_>, Vec<_>) = replays_with_outcomes(store, letter)
        .await
        .map_err(fail)?
        .into_iter()
        .map(|(r, journal)| {
            let outcome = journal
                .iter()
                .map(JournalEntry::described)
                .collect::<Vec<_>>()
                .join(", ");
            (r, outcome)
        })
        .unzip();
    let headers: serde_json::Value =
        serde_json::from_str(&record.headers).unwrap_or(serde_json::Value::Null);
    let l = &record.letter;
    if json {
        let mut v = letter_json(l);
        v["headers"] = headers;
        if show_payload {
            v["body"] = String::from_utf8_lossy(record.body_to_send()).into();
        }
        v["edited"] = record.edit.is_some().into();
        v["replays"] = replays
            .iter()
            .zip(&outcomes)
            .map(|(r, o)| {
                serde_json::json!({
                    "replayId": r.replay_id, "by": r.requested_by, "osUser": r.os_user,
                    "edited": r.edited, "at": r.created_at.to_rfc3339(),
                    "published": r.published_at.map(|t| t.to_rfc3339()), "outcome": o,
                })
            })
            .collect();
        println!("{}", printable_json(&v));
        return Ok(());
    }
    println!("letter:      {}", l.letter_id);
    println!("state:       {}", l.state.as_str());
    println!("message id:  {}", id(&l.message_id));
    println!("type:        {}", printable(&l.event_type));
    println!("reason:      {}", printable(&l.reason));
    println!("group:       {}", printable(&l.group_key));
    println!("attempts:    {}", l.attempts);
    println!("consumer:    {}", printable(&l.consumer));
    println!("queue:       {}", printable(&l.queue));
    println!(
        "published:   exchange {}, routing key {}",
        printable(&format!("{:?}", l.original_exchange)),
        printable(&format!("{:?}", l.original_routing_key))
    );
    println!("correlation: {}", id(&l.correlation_id));
    println!("first fail:  {}", time(l.first_failure));
    println!("last fail:   {}", time(l.last_failure));
    println!("error:       {}", printable(&l.error));
    if !l.replay_id.is_empty() {
        println!("failed copy: of replay {}", l.replay_id);
    }
    if l.body_truncated {
        println!("body:        CUT when stored; the whole letter waits on the side queue");
    }
    println!("headers:");
    for (k, text) in record.header_texts() {
        println!("  {}: {}", printable(&k), printable(&text));
    }
    if let Some(edit) = &record.edit {
        println!(
            "edited:      by {} at {}: {}",
            printable(&edit.by),
            time(edit.at),
            printable(&edit.reason)
        );
    }
    for (r, outcome) in replays.iter().zip(&outcomes) {
        println!(
            "replayed:    {} by {} ({}) at {}{}: {}",
            r.replay_id,
            printable(&r.requested_by),
            printable(&r.os_user),
            time(r.created_at),
            if r.edited { ", edited body" } else { "" },
            match (r.published_at, outcome.as_str()) {
                (None, _) => "not published yet".to_owned(),
                (Some(_), "") => "no outcome journaled yet".to_owned(),
                (Some(_), o) => printable(o).into_owned(),
            }
        );
    }
    if show_payload {
        if let Some(edit) = &record.edit {
            println!(
                "original:    {}",
                warren_admin::printable_bytes(&record.body)
            );
            println!("edited body: {}", warren_admin::printable_bytes(&edit.body));
        } else {
            println!(
                "body:        {}",
                warren_admin::printable_bytes(&record.body)
            );
        }
    }
    Ok(())
}

fn print_groups(groups: &[DeadLetterGroup], mutes: &[GroupMute], json: bool) {
    let now = Utc::now();
    let muted = |g: &DeadLetterGroup| {
        mutes
            .iter()
            .find(|m| m.group_key == g.group_key && m.holds(g.count, now))
    };
    if json {
        for g in groups {
            let v = serde_json::json!({
                "group": g.group_key, "count": g.count,
                "firstSeen": g.first_seen.to_rfc3339(), "lastSeen": g.last_seen.to_rfc3339(),
                "type": g.event_type, "reason": g.reason, "sampleError": g.sample_error,
                "muted": muted(g).is_some(),
            });
            println!("{}", printable_json(&v));
        }
        return;
    }
    println!(
        "{:<16} {:>7} {:<19} {:<19} {:<28} {:<22} SAMPLE ERROR",
        "GROUP", "COUNT", "FIRST SEEN", "LAST SEEN", "TYPE", "REASON"
    );
    for g in groups {
        println!(
            "{:<16} {:>7} {:<19} {:<19} {:<28} {:<22} {}{}",
            one_line(&g.group_key, 64),
            g.count,
            time(g.first_seen),
            time(g.last_seen),
            one_line(&g.event_type, 28),
            one_line(&g.reason, 22),
            one_line(&g.sample_error, 80),
            muted(g).map_or_else(String::new, |m| format!("  [muted {}]", mute_text(m)))
        );
    }
    println!("{} group(s)", groups.len());
}

fn print_list(letters: &[StoredDeadLetter], limit: u32, json: bool) {
    if json {
        for l in letters {
            println!("{}", printable_json(&letter_json(l)));
        }
    } else {
        println!(
            "{:<32} {:<38} {:<28} {:<22} {:>8} {:<19} ERROR",
            "LETTER", "MESSAGE ID", "TYPE", "REASON", "ATTEMPTS", "LAST FAILURE"
        );
        for l in letters {
            println!(
                "{:<32} {:<38} {:<28} {:<22} {:>8} {:<19} {}",
                l.letter_id,
                one_line(&id(&l.message_id), 38),
                one_line(&l.event_type, 28),
                one_line(&l.reason, 22),
                l.attempts,
                time(l.last_failure),
                one_line(&l.error, 80)
            );
        }
        println!("{} letter(s)", letters.len());
    }
    if letters.len() as u64 == u64::from(limit)
        && let Some(last) = letters.last()
    {
        eprintln!("next page: --after {}", PageAfter::after(last).cursor());
    }
}

fn letter_json(l: &StoredDeadLetter) -> serde_json::Value {
    serde_json::json!({
        "letterId": l.letter_id, "state": l.state.as_str(), "messageId": l.message_id,
        "type": l.event_type, "reason": l.reason, "error": l.error, "attempts": l.attempts,
        "group": l.group_key, "consumer": l.consumer, "queue": l.queue,
        "correlationId": l.correlation_id, "replayId": l.replay_id,
        "originalExchange": l.original_exchange, "originalRoutingKey": l.original_routing_key,
        "firstFailure": l.first_failure.to_rfc3339(), "lastFailure": l.last_failure.to_rfc3339(),
        "bodyTruncated": l.body_truncated,
    })
}

fn mute_text(m: &GroupMute) -> String {
    let mut parts = Vec::new();
    if let Some(t) = m.until {
        parts.push(format!("until {}", time(t)));
    }
    if let Some(g) = m.grow_limit {
        parts.push(format!(
            "until it grows past {}",
            m.count_at_mute.saturating_add(g)
        ));
    }
    parts.join(" or ")
}

fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// Opens `$EDITOR` (else `vi`) on the envelope, pretty-printed, and returns
/// what was saved.
fn edit_in_editor(body: &[u8]) -> Result<Vec<u8>, CliError> {
    let pretty = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| serde_json::to_vec_pretty(&v).ok())
        .unwrap_or_else(|| body.to_vec());
    let path = std::env::temp_dir().join(format!(
        "warren-edit-{}-{}.json",
        std::process::id(),
        Utc::now().timestamp_nanos_opt().unwrap_or_default()
    ));
    write_private(&path, &pretty)?;
    let editor = std::env::var("VISUAL")
        .or_else(|_| std::env::var("EDITOR"))
        .unwrap_or_else(|_| "vi".to_owned());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("warren-edit")
        .arg(&path)
        .status();
    let edited = std::fs::read(&path);
    let _ = std::fs::remove_file(&path);
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => {
            return Err(CliError::Failed(format!(
                "{editor} exited with {s}; nothing edited"
            )));
        }
        Err(e) => return Err(CliError::Failed(format!("cannot run {editor}: {e}"))),
    }
    let edited = edited.map_err(|e| CliError::Failed(format!("cannot read the edit back: {e}")))?;
    // Saved as it was shown: compact it again, so that an untouched letter
    // is seen as unchanged.
    Ok(serde_json::from_slice::<serde_json::Value>(&edited)
        .ok()
        .and_then(|v| serde_json::to_vec(&v).ok())
        .unwrap_or(edited))
}

/// Writes a file only its owner can read: payloads are payment and personal
/// data.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> Result<(), CliError> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", path.display())))?;
    file.write_all(bytes)
        .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", path.display())))
}
