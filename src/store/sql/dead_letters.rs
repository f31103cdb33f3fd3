//! The dead-letter store on every SQL dialect: the statements are built here
//! once, with the dialect's placeholders, and what differs between databases
//! (the insert that leaves a stored letter alone, the payload search) is the
//! dialect's.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::super::dead_letters::{
    Actor, AuditEntry, DeadLetterGroup, DeadLetterRecord, DeadLetterStats, DeadLetterStore,
    GroupMute, LetterEdit, LetterFilter, LetterReplay, LetterState, NewDeadLetter, PageAfter,
    PendingReplay, ReplayCandidate, ReplayRun, StoredDeadLetter,
};
use super::*;

/// The columns of a listed letter, in the order [`listed`] reads them.
const LISTED: &str = "letter_id, consumer_name, queue_name, message_id, event_type, \
     correlation_id, replay_id, reason, error, attempts, original_exchange, \
     original_routing_key, first_failure, last_failure, group_key, state, body_truncated";

/// A value bound into a statement built at run time.
pub(super) enum Bind<D: Dialect> {
    Text(String),
    Time(D::Time),
    Int(i64),
    Bool(bool),
    OptTime(Option<D::Time>),
    OptInt(Option<i64>),
    Bytes(Vec<u8>),
}

/// A statement's `WHERE` clause, built a condition at a time with the
/// dialect's placeholders, and the values to bind in order.
pub(super) struct Conditions<D: Dialect> {
    pub(super) sql: Vec<String>,
    pub(super) binds: Vec<Bind<D>>,
}

impl<D: Dialect> Conditions<D> {
    pub(super) fn new() -> Self {
        Self {
            sql: Vec::new(),
            binds: Vec::new(),
        }
    }

    /// The placeholder of the next value to bind.
    pub(super) fn next(&self) -> String {
        D::numbered_placeholder(self.binds.len() + 1).unwrap_or_else(|| "?".to_owned())
    }

    pub(super) fn push(&mut self, column_op: &str, value: Bind<D>) {
        let placeholder = self.next();
        self.sql.push(format!("{column_op} {placeholder}"));
        self.binds.push(value);
    }

    /// `column` equal to `value`, byte for byte, on every dialect.
    fn push_text_equals(&mut self, column: &str, value: &str) {
        let mut n = self.binds.len();
        let mut next = || {
            n += 1;
            D::numbered_placeholder(n).unwrap_or_else(|| "?".to_owned())
        };
        let (sql, count) = D::text_equals(&mut next, column);
        self.sql.push(sql);
        self.binds
            .extend((0..count).map(|_| Bind::Text(value.to_owned())));
    }

    fn of(filter: &LetterFilter) -> Self {
        let mut c = Self::new();
        c.filter(filter);
        c
    }

    /// A value bound outside the `WHERE` clause (a `SET`, a `LIMIT`): its
    /// placeholder.
    pub(super) fn value(&mut self, value: Bind<D>) -> String {
        let placeholder = self.next();
        self.binds.push(value);
        placeholder
    }

    fn filter(&mut self, filter: &LetterFilter) {
        let c = self;
        c.push("state =", Bind::Text(filter.state.as_str().to_owned()));
        let texts = [
            ("consumer_name", &filter.consumer),
            ("event_type", &filter.event_type),
            ("reason", &filter.reason),
            ("group_key", &filter.group),
            ("message_id", &filter.message_id),
            ("correlation_id", &filter.correlation_id),
            ("letter_id", &filter.letter_id),
        ];
        for (column, value) in texts {
            if let Some(v) = value {
                c.push_text_equals(column, v);
            }
        }
        if let Some(t) = filter.since {
            c.push("last_failure >=", Bind::Time(letter_time::<D>(t)));
        }
        if let Some(t) = filter.until {
            c.push("last_failure <", Bind::Time(letter_time::<D>(t)));
        }
        if let Some((field, value)) = &filter.payload_field {
            let mut n = c.binds.len();
            let mut next = || {
                n += 1;
                D::numbered_placeholder(n).unwrap_or_else(|| "?".to_owned())
            };
            let (sql, binds) = D::payload_condition(&mut next, field, value);
            c.sql.push(sql);
            c.binds.extend(binds.into_iter().map(Bind::Text));
        }
    }

    pub(super) fn where_clause(&self) -> String {
        format!("WHERE {}", self.sql.join(" AND "))
    }
}

shared_impl! {
    impl DeadLetterStore {
        async fn store_dead_letter<'a>(&'a self, l: &'a NewDeadLetter) -> Result<bool, StoreError> {
            let _turn = self.write_turn().await?;
            let done = sqlx::query(D::INSERT_DEAD_LETTER)
                .bind(l.letter_id.as_str())
                .bind(l.consumer.as_str())
                .bind(l.queue.as_str())
                .bind(l.message_id.as_str())
                .bind(l.event_type.as_str())
                .bind(l.correlation_id.as_str())
                .bind(l.replay_id.as_str())
                .bind(l.reason.as_str())
                .bind(l.error.as_str())
                .bind(i64::from(l.attempts))
                .bind(l.original_exchange.as_str())
                .bind(l.original_routing_key.as_str())
                .bind(letter_time::<D>(l.first_failure))
                .bind(letter_time::<D>(l.last_failure))
                .bind(l.fingerprint.as_str())
                .bind(l.fingerprint.as_str())
                .bind(l.headers.as_str())
                .bind(l.properties.as_str())
                .bind(l.body.as_slice())
                .bind(l.body_truncated)
                .bind(l.payload.as_deref())
                .bind(l.redacted_fields.as_str())
                .bind(l.entity.as_str())
                .bind(l.entity_version)
                .bind(LetterState::Unresolved.as_str())
                .execute(&self.pool)
                .await;
            let stored = match done {
                Ok(done) => D::rows_affected(&done) == 1,
                Err(e) if D::is_refused_claim(&e) => false,
                Err(e) => return Err(e.into()),
            };
            if stored {
                return Ok(true);
            }
            // Its id is stored. The same copy again (its ack lost) changes
            // nothing; a later failure of a letter already dealt with (the
            // message republished, or replayed from the broker side) opens it
            // again, with its new failure.
            let mut c = Conditions::<D>::new();
            let state = c.value(Bind::Text(LetterState::Unresolved.as_str().to_owned()));
            let last = c.value(Bind::Time(letter_time::<D>(l.last_failure)));
            let error = c.value(Bind::Text(l.error.clone()));
            let attempts = c.value(Bind::Int(i64::from(l.attempts)));
            let at = c.value(Bind::Time(D::time(Utc::now())));
            c.push("letter_id =", Bind::Text(l.letter_id.clone()));
            c.push("state <>", Bind::Text(LetterState::Unresolved.as_str().to_owned()));
            c.push("last_failure <", Bind::Time(letter_time::<D>(l.last_failure)));
            let sql = format!(
                "UPDATE warren_dead_letters
                 SET state = {state}, last_failure = {last}, error = {error}, attempts = {attempts},
                     state_changed_at = {at}
                 {}",
                c.where_clause()
            );
            let done = run_built!(&self.pool, sql, c, execute);
            Ok(D::rows_affected(&done) == 1)
        }

        async fn dead_letter_groups<'a>(
            &'a self,
            filter: &'a LetterFilter,
            limit: u32,
        ) -> Result<Vec<DeadLetterGroup>, StoreError> {
            let mut c = Conditions::<D>::of(filter);
            let limit_ph = c.next();
            c.binds.push(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT group_key, MIN({}), MIN({}), COUNT(*), MIN(first_failure),
                        MAX(last_failure), MIN({})
                 FROM warren_dead_letters {}
                 GROUP BY group_key
                 ORDER BY COUNT(*) DESC, MAX(last_failure) DESC, {}
                 LIMIT {limit_ph}",
                D::binary("reason"),
                D::binary("event_type"),
                D::binary("error"),
                c.where_clause(),
                D::binary("group_key"),
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter()
                .map(|row| {
                    Ok(DeadLetterGroup {
                        group_key: row.try_get(0)?,
                        reason: row.try_get(1)?,
                        event_type: row.try_get(2)?,
                        count: u64::try_from(row.try_get::<i64, _>(3)?).unwrap_or(0),
                        first_seen: time_of::<D>(row.try_get(4)?)?,
                        last_seen: time_of::<D>(row.try_get(5)?)?,
                        sample_error: row.try_get(6)?,
                    })
                })
                .collect()
        }

        async fn dead_letters<'a>(
            &'a self,
            filter: &'a LetterFilter,
            after: Option<&'a PageAfter>,
            limit: u32,
        ) -> Result<Vec<StoredDeadLetter>, StoreError> {
            let mut c = Conditions::<D>::of(filter);
            if let Some(after) = after {
                // Newest first: the page goes on below the last letter shown.
                let t1 = c.next();
                c.binds.push(Bind::Time(letter_time::<D>(after.last_failure)));
                let t2 = c.next();
                c.binds.push(Bind::Time(letter_time::<D>(after.last_failure)));
                let id = c.next();
                c.binds.push(Bind::Text(after.letter_id.clone()));
                let letter = D::binary("letter_id");
                c.sql.push(format!(
                    "(last_failure < {t1} OR (last_failure = {t2} AND {letter} < {id}))"
                ));
            }
            let limit_ph = c.next();
            c.binds.push(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT {LISTED} FROM warren_dead_letters {}
                 ORDER BY last_failure DESC, {} DESC
                 LIMIT {limit_ph}",
                c.where_clause(),
                D::binary("letter_id"),
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter().map(|row| listed::<D>(row)).collect()
        }

        async fn dead_letter<'a>(
            &'a self,
            letter_id: &'a str,
        ) -> Result<Option<DeadLetterRecord>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("letter_id =", Bind::Text(letter_id.to_owned()));
            let sql = format!(
                "SELECT {LISTED}, headers, properties, body, edited_body, edited_by, edit_reason,
                        edited_at
                 FROM warren_dead_letters {}",
                c.where_clause()
            );
            let row = run_built!(&self.pool, sql, c, fetch_optional);
            row.map(|row| {
                Ok(DeadLetterRecord {
                    letter: listed::<D>(&row)?,
                    headers: row.try_get(17)?,
                    properties: row.try_get(18)?,
                    body: row.try_get(19)?,
                    edit: match row.try_get::<Option<Vec<u8>>, _>(20)? {
                        Some(body) => Some(LetterEdit {
                            body,
                            by: row.try_get::<Option<String>, _>(21)?.unwrap_or_default(),
                            reason: row.try_get::<Option<String>, _>(22)?.unwrap_or_default(),
                            at: row
                                .try_get::<Option<D::Time>, _>(23)?
                                .map(time_of::<D>)
                                .transpose()?
                                .unwrap_or_default(),
                        }),
                        None => None,
                    },
                })
            })
            .transpose()
        }

        async fn resolve_dead_letters<'a>(
            &'a self,
            filter: &'a LetterFilter,
            actor: &'a Actor,
        ) -> Result<u64, StoreError> {
            let mut c = Conditions::<D>::new();
            let state = c.value(Bind::Text(LetterState::Resolved.as_str().to_owned()));
            let at = c.value(Bind::Time(D::time(Utc::now())));
            c.filter(filter);
            let sql = format!(
                "UPDATE warren_dead_letters SET state = {state}, state_changed_at = {at} {}",
                c.where_clause()
            );
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let done = run_built!(&mut *tx, sql, c, execute);
            let n = D::rows_affected(&done);
            audit_in::<D>(&mut tx, actor, "resolve", &filter.describe(), &format!("{n} letters"), false)
                .await?;
            tx.commit().await?;
            Ok(n)
        }

        async fn reclassify_dead_letters<'a>(
            &'a self,
            filter: &'a LetterFilter,
            group: &'a str,
            actor: &'a Actor,
        ) -> Result<u64, StoreError> {
            let mut c = Conditions::<D>::new();
            let to = c.value(Bind::Text(group.to_owned()));
            c.filter(filter);
            let sql = format!(
                "UPDATE warren_dead_letters SET group_key = {to} {}",
                c.where_clause()
            );
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let done = run_built!(&mut *tx, sql, c, execute);
            let n = D::rows_affected(&done);
            let detail = format!("{n} letters moved to group {group}");
            audit_in::<D>(&mut tx, actor, "reclassify", &filter.describe(), &detail, false).await?;
            tx.commit().await?;
            Ok(n)
        }

        async fn mute_group<'a>(
            &'a self,
            group: &'a str,
            until: Option<DateTime<Utc>>,
            grow_limit: Option<u64>,
            reason: &'a str,
            actor: &'a Actor,
        ) -> Result<GroupMute, StoreError> {
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let mut c = Conditions::<D>::new();
            c.push("state =", Bind::Text(LetterState::Unresolved.as_str().to_owned()));
            c.push("group_key =", Bind::Text(group.to_owned()));
            let sql = format!("SELECT COUNT(*) FROM warren_dead_letters {}", c.where_clause());
            let count: i64 = bind_all!(sqlx::query_scalar(sqlx::AssertSqlSafe(sql)), c.binds)
                .fetch_one(&mut *tx)
                .await?;
            let mut c = Conditions::<D>::new();
            c.push("group_key =", Bind::Text(group.to_owned()));
            let sql = format!("DELETE FROM warren_dead_letter_mutes {}", c.where_clause());
            run_built!(&mut *tx, sql, c, execute);
            let mut c = Conditions::<D>::new();
            let values = [
                c.value(Bind::Text(group.to_owned())),
                c.value(Bind::OptTime(until.map(D::time))),
                c.value(Bind::OptInt(grow_limit.map(saturating_i64))),
                c.value(Bind::Int(count)),
                c.value(Bind::Text(actor.operator.clone())),
                c.value(Bind::Text(reason.to_owned())),
                c.value(Bind::Time(D::time(Utc::now()))),
            ];
            let sql = format!(
                "INSERT INTO warren_dead_letter_mutes
                     (group_key, muted_until, grow_limit, count_at_mute, muted_by, reason, muted_at)
                 VALUES ({})",
                values.join(", ")
            );
            run_built!(&mut *tx, sql, c, execute);
            let mute = GroupMute {
                group_key: group.to_owned(),
                until,
                grow_limit,
                count_at_mute: u64::try_from(count).unwrap_or(0),
                reason: reason.to_owned(),
            };
            let detail = format!(
                "until {}, or {} more letters; {count} letters now; {reason}",
                until.map_or_else(|| "lifted".to_owned(), |t| t.to_rfc3339()),
                grow_limit.map_or_else(|| "any number of".to_owned(), |g| g.to_string()),
            );
            audit_in::<D>(&mut tx, actor, "mute", group, &detail, false).await?;
            tx.commit().await?;
            Ok(mute)
        }

        async fn unmute_group<'a>(&'a self, group: &'a str, actor: &'a Actor) -> Result<bool, StoreError> {
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let mut c = Conditions::<D>::new();
            c.push("group_key =", Bind::Text(group.to_owned()));
            let sql = format!("DELETE FROM warren_dead_letter_mutes {}", c.where_clause());
            let done = run_built!(&mut *tx, sql, c, execute);
            let was = D::rows_affected(&done) > 0;
            if was {
                audit_in::<D>(&mut tx, actor, "unmute", group, "", false).await?;
            }
            tx.commit().await?;
            Ok(was)
        }

        async fn group_mutes(&self) -> Result<Vec<GroupMute>, StoreError> {
            let rows = sqlx::query(
                "SELECT group_key, muted_until, grow_limit, count_at_mute, reason
                 FROM warren_dead_letter_mutes ORDER BY group_key",
            )
            .fetch_all(&self.pool)
            .await?;
            rows.iter()
                .map(|row| {
                    Ok(GroupMute {
                        group_key: row.try_get(0)?,
                        until: row.try_get::<Option<D::Time>, _>(1)?.map(time_of::<D>).transpose()?,
                        grow_limit: row
                            .try_get::<Option<i64>, _>(2)?
                            .map(|g| u64::try_from(g).unwrap_or(0)),
                        count_at_mute: u64::try_from(row.try_get::<i64, _>(3)?).unwrap_or(0),
                        reason: row.try_get(4)?,
                    })
                })
                .collect()
        }

        async fn purge_dead_letters(
            &self,
            state: LetterState,
            before: DateTime<Utc>,
            limit: u32,
        ) -> Result<u64, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("state =", Bind::Text(state.as_str().to_owned()));
            c.push("state_changed_at <", Bind::Time(D::time(before)));
            let limit = c.value(Bind::Int(i64::from(limit)));
            // The doomed ids through a derived table: MySQL takes no LIMIT in
            // an IN subquery, nor a subquery on the table it deletes from.
            let sql = format!(
                "DELETE FROM warren_dead_letters WHERE letter_id IN (
                     SELECT letter_id FROM (
                         SELECT letter_id FROM warren_dead_letters {} LIMIT {limit}) doomed)",
                c.where_clause()
            );
            let _turn = self.write_turn().await?;
            let done = run_built!(&self.pool, sql, c, execute);
            Ok(D::rows_affected(&done))
        }

        async fn audit<'a>(
            &'a self,
            actor: &'a Actor,
            action: &'a str,
            target: &'a str,
            detail: &'a str,
            forced: bool,
        ) -> Result<(), StoreError> {
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            audit_in::<D>(&mut tx, actor, action, target, detail, forced).await?;
            tx.commit().await?;
            Ok(())
        }

        async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
            let mut c = Conditions::<D>::new();
            let limit = c.value(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT at, operator, os_user, action, target, detail, forced
                 FROM warren_audit ORDER BY id DESC LIMIT {limit}"
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter()
                .map(|row| {
                    Ok(AuditEntry {
                        at: time_of::<D>(row.try_get(0)?)?,
                        operator: row.try_get(1)?,
                        os_user: row.try_get(2)?,
                        action: row.try_get(3)?,
                        target: row.try_get(4)?,
                        detail: row.try_get(5)?,
                        forced: row.try_get(6)?,
                    })
                })
                .collect()
        }

        async fn replay_candidates<'a>(
            &'a self,
            filter: &'a LetterFilter,
            limit: u32,
        ) -> Result<Vec<ReplayCandidate>, StoreError> {
            let mut c = Conditions::<D>::of(filter);
            let limit = c.value(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT letter_id, consumer_name, message_id, entity, entity_version, first_failure,
                        body_truncated, edited_body IS NOT NULL
                 FROM warren_dead_letters {} LIMIT {limit}",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter()
                .map(|row| {
                    Ok(ReplayCandidate {
                        letter_id: row.try_get(0)?,
                        consumer: row.try_get(1)?,
                        message_id: row.try_get(2)?,
                        entity: row.try_get(3)?,
                        entity_version: row.try_get(4)?,
                        first_failure: time_of::<D>(row.try_get(5)?)?,
                        body_truncated: row.try_get(6)?,
                        edited: row.try_get(7)?,
                    })
                })
                .collect()
        }

        async fn create_replay_run<'a>(
            &'a self,
            run_id: &'a str,
            selection: &'a str,
            letters: &'a [ReplayCandidate],
            careful: bool,
            actor: &'a Actor,
            forced: bool,
        ) -> Result<(), StoreError> {
            let now = Utc::now();
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let mut c = Conditions::<D>::new();
            let values = [
                c.value(Bind::Text(run_id.to_owned())),
                c.value(Bind::Text(selection.to_owned())),
                c.value(Bind::Bool(careful)),
                c.value(Bind::Text("running".to_owned())),
                c.value(Bind::Text(String::new())),
                c.value(Bind::Int(saturating_i64(letters.len() as u64))),
                c.value(Bind::Text(actor.operator.clone())),
                c.value(Bind::Text(actor.os_user.clone())),
                c.value(Bind::Time(D::time(now))),
                c.value(Bind::Time(D::time(now))),
            ];
            let sql = format!(
                "INSERT INTO warren_replay_runs
                     (run_id, selection, careful, state, stop_reason, total, started_by, os_user, started_at,
                      updated_at)
                 VALUES ({})",
                values.join(", ")
            );
            run_built!(&mut *tx, sql, c, execute);
            // Many rows a statement: a run of 100 000 letters is 200
            // statements, not 100 000 round trips.
            for (chunk_no, chunk) in letters.chunks(REPLAY_ROWS_PER_INSERT).enumerate() {
                let mut c = Conditions::<D>::new();
                let mut rows = Vec::with_capacity(chunk.len());
                for (i, letter) in chunk.iter().enumerate() {
                    let seq = (chunk_no * REPLAY_ROWS_PER_INSERT + i + 1) as i64;
                    let row = [
                        c.value(Bind::Text(format!("{run_id}.{seq}"))),
                        c.value(Bind::Text(letter.letter_id.clone())),
                        c.value(Bind::Text(run_id.to_owned())),
                        c.value(Bind::Int(seq)),
                        c.value(Bind::Text(letter.consumer.clone())),
                        c.value(Bind::Text(letter.message_id.clone())),
                        c.value(Bind::Text(actor.operator.clone())),
                        c.value(Bind::Text(actor.os_user.clone())),
                        c.value(Bind::Bool(letter.edited)),
                        c.value(Bind::Time(D::time(now))),
                    ];
                    rows.push(format!("({})", row.join(", ")));
                }
                let sql = format!(
                    "INSERT INTO warren_replays
                         (replay_id, letter_id, run_id, seq, consumer_name, message_id, requested_by,
                          os_user, edited, created_at)
                     VALUES {}",
                    rows.join(", ")
                );
                run_built!(&mut *tx, sql, c, execute);
            }
            let detail = format!("run {run_id}: {} letters", letters.len());
            audit_in::<D>(&mut tx, actor, "replay", selection, &detail, forced).await?;
            tx.commit().await?;
            Ok(())
        }

        async fn replay_run<'a>(&'a self, run_id: &'a str) -> Result<Option<ReplayRun>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("r.run_id =", Bind::Text(run_id.to_owned()));
            let sql = format!(
                "SELECT r.run_id, r.selection, r.total,
                        (SELECT COUNT(*) FROM warren_replays p
                          WHERE p.run_id = r.run_id AND p.published_at IS NOT NULL),
                        r.state, r.stop_reason, r.started_by, r.started_at, r.careful
                 FROM warren_replay_runs r {}",
                c.where_clause()
            );
            let row = run_built!(&self.pool, sql, c, fetch_optional);
            row.map(|row| {
                Ok(ReplayRun {
                    run_id: row.try_get(0)?,
                    selection: row.try_get(1)?,
                    total: u64::try_from(row.try_get::<i64, _>(2)?).unwrap_or(0),
                    published: u64::try_from(row.try_get::<i64, _>(3)?).unwrap_or(0),
                    state: row.try_get(4)?,
                    stop_reason: row.try_get(5)?,
                    started_by: row.try_get(6)?,
                    started_at: time_of::<D>(row.try_get(7)?)?,
                    careful: row.try_get(8)?,
                })
            })
            .transpose()
        }

        async fn pending_replays<'a>(
            &'a self,
            run_id: &'a str,
            limit: u32,
        ) -> Result<Vec<PendingReplay>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("run_id =", Bind::Text(run_id.to_owned()));
            c.sql.push("published_at IS NULL".to_owned());
            let limit = c.value(Bind::Int(i64::from(limit)));
            let sql = format!(
                "SELECT replay_id, letter_id, seq FROM warren_replays {}
                 ORDER BY seq LIMIT {limit}",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter()
                .map(|row| {
                    Ok(PendingReplay {
                        replay_id: row.try_get(0)?,
                        letter_id: row.try_get(1)?,
                        seq: u64::try_from(row.try_get::<i64, _>(2)?).unwrap_or(0),
                    })
                })
                .collect()
        }

        async fn letter_replays<'a>(&'a self, letter_id: &'a str) -> Result<Vec<LetterReplay>, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("letter_id =", Bind::Text(letter_id.to_owned()));
            let sql = format!(
                "SELECT replay_id, run_id, requested_by, os_user, edited, created_at, published_at
                 FROM warren_replays {} ORDER BY created_at, seq",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            rows.iter()
                .map(|row| {
                    Ok(LetterReplay {
                        replay_id: row.try_get(0)?,
                        run_id: row.try_get(1)?,
                        requested_by: row.try_get(2)?,
                        os_user: row.try_get(3)?,
                        edited: row.try_get(4)?,
                        created_at: time_of::<D>(row.try_get(5)?)?,
                        published_at: row
                            .try_get::<Option<D::Time>, _>(6)?
                            .map(time_of::<D>)
                            .transpose()?,
                    })
                })
                .collect()
        }

        async fn replays_published<'a>(&'a self, replays: &'a [PendingReplay]) -> Result<(), StoreError> {
            if replays.is_empty() {
                return Ok(());
            }
            let now = Utc::now();
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            for replay in replays {
                let mut c = Conditions::<D>::new();
                let at = c.value(Bind::Time(D::time(now)));
                c.push("replay_id =", Bind::Text(replay.replay_id.clone()));
                let sql =
                    format!("UPDATE warren_replays SET published_at = {at} {}", c.where_clause());
                run_built!(&mut *tx, sql, c, execute);
                let mut c = Conditions::<D>::new();
                let state = c.value(Bind::Text(LetterState::Replayed.as_str().to_owned()));
                let last = c.value(Bind::Text(replay.replay_id.clone()));
                let at = c.value(Bind::Time(D::time(now)));
                c.push("letter_id =", Bind::Text(replay.letter_id.clone()));
                let sql = format!(
                    "UPDATE warren_dead_letters
                     SET state = {state}, replay_count = replay_count + 1, last_replay_id = {last},
                         state_changed_at = {at}
                     {}",
                    c.where_clause()
                );
                run_built!(&mut *tx, sql, c, execute);
                // The journal's record of the replay, beside the outcome the
                // consumer will journal for the same replay id.
                let mut c = Conditions::<D>::new();
                let outcome = c.value(Bind::Text("replayed".to_owned()));
                let detail = c.value(Bind::Text(format!("letter {}", replay.letter_id)));
                let at = c.value(Bind::Time(D::time(now)));
                c.push("replay_id =", Bind::Text(replay.replay_id.clone()));
                let sql = format!(
                    "INSERT INTO warren_journal (consumer_name, message_id, replay_id, outcome, detail, at)
                     SELECT consumer_name, message_id, replay_id, {outcome}, {detail}, {at}
                     FROM warren_replays {}",
                    c.where_clause()
                );
                run_built!(&mut *tx, sql, c, execute);
            }
            tx.commit().await?;
            Ok(())
        }

        async fn end_replay_run<'a>(
            &'a self,
            run_id: &'a str,
            state: &'a str,
            reason: &'a str,
        ) -> Result<(), StoreError> {
            let mut c = Conditions::<D>::new();
            let s = c.value(Bind::Text(state.to_owned()));
            let r = c.value(Bind::Text(reason.to_owned()));
            let at = c.value(Bind::Time(D::time(Utc::now())));
            c.push("run_id =", Bind::Text(run_id.to_owned()));
            let sql = format!(
                "UPDATE warren_replay_runs SET state = {s}, stop_reason = {r}, updated_at = {at} {}",
                c.where_clause()
            );
            let _turn = self.write_turn().await?;
            run_built!(&self.pool, sql, c, execute);
            Ok(())
        }

        async fn edit_dead_letter<'a>(
            &'a self,
            letter_id: &'a str,
            body: &'a [u8],
            reason: &'a str,
            detail: &'a str,
            actor: &'a Actor,
        ) -> Result<bool, StoreError> {
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let mut c = Conditions::<D>::new();
            let b = c.value(Bind::Bytes(body.to_vec()));
            let by = c.value(Bind::Text(actor.operator.clone()));
            let why = c.value(Bind::Text(reason.to_owned()));
            let at = c.value(Bind::Time(D::time(Utc::now())));
            c.push("letter_id =", Bind::Text(letter_id.to_owned()));
            let sql = format!(
                "UPDATE warren_dead_letters
                 SET edited_body = {b}, edited_by = {by}, edit_reason = {why}, edited_at = {at} {}",
                c.where_clause()
            );
            let done = run_built!(&mut *tx, sql, c, execute);
            if D::rows_affected(&done) == 0 {
                return Ok(false);
            }
            let detail = format!("{reason}: {detail}");
            audit_in::<D>(&mut tx, actor, "edit", letter_id, &detail, false).await?;
            tx.commit().await?;
            Ok(true)
        }

        async fn edits_allowed(&self) -> Result<bool, StoreError> {
            let value: Option<String> = sqlx::query_scalar(D::SQL.select_setting)
                .bind(EDIT_SETTING)
                .fetch_optional(&self.pool)
                .await?;
            Ok(value.as_deref() != Some("off"))
        }

        async fn allow_edits<'a>(&'a self, allowed: bool, actor: &'a Actor) -> Result<(), StoreError> {
            let value = if allowed { "on" } else { "off" };
            let _turn = self.write_turn().await?;
            let mut tx = self.pool.begin_with(D::SQL.begin).await?;
            let mut c = Conditions::<D>::new();
            c.push("name =", Bind::Text(EDIT_SETTING.to_owned()));
            let sql = format!("DELETE FROM warren_settings {}", c.where_clause());
            run_built!(&mut *tx, sql, c, execute);
            sqlx::query(D::SQL.insert_setting)
                .bind(EDIT_SETTING)
                .bind(value)
                .execute(&mut *tx)
                .await?;
            audit_in::<D>(&mut tx, actor, "policy", EDIT_SETTING, value, false).await?;
            tx.commit().await?;
            Ok(())
        }

        async fn dead_letter_stats(&self) -> Result<DeadLetterStats, StoreError> {
            let mut c = Conditions::<D>::new();
            c.push("state =", Bind::Text(LetterState::Unresolved.as_str().to_owned()));
            let sql = format!(
                "SELECT group_key, COUNT(*), MIN(last_failure) FROM warren_dead_letters {}
                 GROUP BY group_key ORDER BY COUNT(*) DESC",
                c.where_clause()
            );
            let rows = run_built!(&self.pool, sql, c, fetch_all);
            let mut unresolved_by_group = Vec::with_capacity(rows.len());
            let mut oldest_unresolved: Option<DateTime<Utc>> = None;
            for row in &rows {
                let count: i64 = row.try_get(1)?;
                unresolved_by_group.push((row.try_get(0)?, u64::try_from(count).unwrap_or(0)));
                let oldest = time_of::<D>(row.try_get(2)?)?;
                oldest_unresolved = Some(oldest_unresolved.map_or(oldest, |o| o.min(oldest)));
            }
            let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM warren_dead_letters")
                .fetch_one(&self.pool)
                .await?;
            let bytes = match D::DEAD_LETTER_BYTES {
                Some(sql) => sqlx::query_scalar::<_, Option<i64>>(sql)
                    .fetch_one(&self.pool)
                    .await?
                    .and_then(|b| u64::try_from(b).ok()),
                None => None,
            };
            Ok(DeadLetterStats {
                unresolved_by_group,
                oldest_unresolved,
                rows: u64::try_from(rows).unwrap_or(0),
                bytes,
            })
        }
    }
}

/// Writes one audit line in `tx`, beside the change it records.
async fn audit_in<D>(
    conn: &mut D::Connection,
    actor: &Actor,
    action: &str,
    target: &str,
    detail: &str,
    forced: bool,
) -> Result<(), StoreError>
where
    D: Dialect,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    i64: for<'q> Encode<'q, D> + Type<D>,
    String: for<'q> Encode<'q, D> + Type<D>,
    Option<i64>: for<'q> Encode<'q, D> + Type<D>,
    Option<D::Time>: for<'q> Encode<'q, D> + Type<D>,
    bool: for<'q> Encode<'q, D> + Type<D>,
    Vec<u8>: for<'q> Encode<'q, D> + Type<D>,
{
    let mut c = Conditions::<D>::new();
    let values = [
        c.value(Bind::Time(D::time(Utc::now()))),
        c.value(Bind::Text(actor.operator.clone())),
        c.value(Bind::Text(actor.os_user.clone())),
        c.value(Bind::Text(action.to_owned())),
        c.value(Bind::Text(target.to_owned())),
        c.value(Bind::Text(detail.to_owned())),
        c.value(Bind::Bool(forced)),
    ];
    let sql = format!(
        "INSERT INTO warren_audit (at, operator, os_user, action, target, detail, forced)
         VALUES ({})",
        values.join(", ")
    );
    run_built!(&mut *conn, sql, c, execute);
    Ok(())
}

/// The setting that switches edits off (`off`) or on.
const EDIT_SETTING: &str = "dead_letters.edit";

/// Replay rows written per `INSERT`: 10 values each, well under every
/// database's limit on bound values (SQLite's 32 766, MySQL's 65 535).
const REPLAY_ROWS_PER_INSERT: usize = 500;

/// `n` as a stored count; counts past `i64::MAX` do not occur.
fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A listed letter, from the columns of [`LISTED`].
fn listed<D>(row: &D::Row) -> Result<StoredDeadLetter, StoreError>
where
    D: Dialect,
    i64: for<'r> Decode<'r, D> + Type<D>,
    String: for<'r> Decode<'r, D> + Type<D>,
    bool: for<'r> Decode<'r, D> + Type<D>,
    usize: ColumnIndex<D::Row>,
{
    let state: String = row.try_get(15)?;
    Ok(StoredDeadLetter {
        letter_id: row.try_get(0)?,
        consumer: row.try_get(1)?,
        queue: row.try_get(2)?,
        message_id: row.try_get(3)?,
        event_type: row.try_get(4)?,
        correlation_id: row.try_get(5)?,
        replay_id: row.try_get(6)?,
        reason: row.try_get(7)?,
        error: row.try_get(8)?,
        attempts: u32::try_from(row.try_get::<i64, _>(9)?).unwrap_or(0),
        original_exchange: row.try_get(10)?,
        original_routing_key: row.try_get(11)?,
        first_failure: time_of::<D>(row.try_get(12)?)?,
        last_failure: time_of::<D>(row.try_get(13)?)?,
        group_key: row.try_get(14)?,
        state: LetterState::from_name(&state).ok_or_else(|| {
            StoreError::Config(format!(
                "warren_dead_letters holds an unknown state {state:?}"
            ))
        })?,
        body_truncated: row.try_get(16)?,
    })
}

/// A stored time, or an error naming it: warren writes every time it reads.
/// A letter's time as every dialect stores and compares it: to the
/// millisecond, which is what SQLite keeps, so that a search or a page
/// boundary finds the same letters on each.
fn letter_time<D: Dialect>(t: DateTime<Utc>) -> D::Time {
    D::time(crate::store::compare::to_millisecond(t))
}

fn time_of<D: Dialect>(t: D::Time) -> Result<DateTime<Utc>, StoreError> {
    D::parse_time(t).ok_or_else(|| StoreError::Config("a stored time does not read as one".into()))
}
