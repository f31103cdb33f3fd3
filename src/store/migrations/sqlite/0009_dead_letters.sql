-- Dead letters kept in the service's database, one row per failure
-- (letter_id), grouped by what made them fail (group_key: the fingerprint
-- unless an operator moved the letter).
CREATE TABLE warren_dead_letters (
    letter_id            TEXT    PRIMARY KEY,
    consumer_name        TEXT    NOT NULL,
    queue_name           TEXT    NOT NULL,
    message_id           TEXT    NOT NULL,
    event_type           TEXT    NOT NULL,
    correlation_id       TEXT    NOT NULL,
    replay_id            TEXT    NOT NULL,
    reason               TEXT    NOT NULL,
    error                TEXT    NOT NULL,
    attempts             INTEGER NOT NULL,
    original_exchange    TEXT    NOT NULL,
    original_routing_key TEXT    NOT NULL,
    first_failure        TEXT    NOT NULL,
    last_failure         TEXT    NOT NULL,
    fingerprint          TEXT    NOT NULL,
    group_key            TEXT    NOT NULL,
    headers              TEXT    NOT NULL,
    properties           TEXT    NOT NULL,
    body                 BLOB    NOT NULL,
    body_truncated       INTEGER NOT NULL,
    payload              TEXT    NULL,
    redacted_fields      TEXT    NOT NULL,
    entity               TEXT    NOT NULL,
    entity_version       INTEGER NULL,
    state                TEXT    NOT NULL,
    edited_body          BLOB    NULL,
    edited_by            TEXT    NULL,
    edit_reason          TEXT    NULL,
    edited_at            TEXT    NULL,
    replay_count         INTEGER NOT NULL DEFAULT 0,
    last_replay_id       TEXT    NOT NULL DEFAULT '',
    ingested_at          TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    state_changed_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE INDEX warren_dead_letters_group ON warren_dead_letters (state, group_key, last_failure);

CREATE INDEX warren_dead_letters_failed ON warren_dead_letters (last_failure);

CREATE INDEX warren_dead_letters_message ON warren_dead_letters (message_id);

CREATE INDEX warren_dead_letters_correlation ON warren_dead_letters (correlation_id);

CREATE INDEX warren_dead_letters_type ON warren_dead_letters (event_type, last_failure);

-- Muted groups: not counted in the alerting metrics until muted_until, or
-- until the group holds more than count_at_mute + grow_limit letters.
CREATE TABLE warren_dead_letter_mutes (
    group_key     TEXT    PRIMARY KEY,
    muted_until   TEXT    NULL,
    grow_limit    INTEGER NULL,
    count_at_mute INTEGER NOT NULL,
    muted_by      TEXT    NOT NULL,
    reason        TEXT    NOT NULL,
    muted_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- A replay run: the letters of a group when it started (its warren_replays
-- rows, made at the start), replayed in seq order, resumable.
CREATE TABLE warren_replay_runs (
    run_id      TEXT    PRIMARY KEY,
    selection   TEXT    NOT NULL,
    careful     INTEGER NOT NULL,
    rate        REAL    NULL,
    state       TEXT    NOT NULL,
    stop_reason TEXT    NOT NULL DEFAULT '',
    total       INTEGER NOT NULL,
    started_by  TEXT    NOT NULL,
    os_user     TEXT    NOT NULL,
    started_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- One row per replay of a letter: made before it is published (published_at
-- NULL), so that a replay interrupted between the two publishes it again
-- under the same replay id.
CREATE TABLE warren_replays (
    replay_id     TEXT    PRIMARY KEY,
    letter_id     TEXT    NOT NULL,
    run_id        TEXT    NOT NULL,
    seq           INTEGER NOT NULL,
    consumer_name TEXT    NOT NULL,
    message_id    TEXT    NOT NULL,
    requested_by  TEXT    NOT NULL,
    os_user       TEXT    NOT NULL,
    edited        INTEGER NOT NULL,
    created_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    published_at  TEXT    NULL
);

CREATE INDEX warren_replays_run ON warren_replays (run_id, seq);

CREATE INDEX warren_replays_letter ON warren_replays (letter_id);

-- The delivery journal: one row per outcome that has no business transaction
-- to ride on (duplicate, stale, retried, parked, dead-lettered, replayed),
-- and per applied outcome of a replayed copy, written in its transaction.
-- Applied outcomes otherwise are their inbox rows.
CREATE TABLE warren_journal (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_name TEXT    NOT NULL,
    message_id    TEXT    NOT NULL,
    replay_id     TEXT    NOT NULL,
    outcome       TEXT    NOT NULL,
    detail        TEXT    NOT NULL,
    at            TEXT    NOT NULL
);

CREATE INDEX warren_journal_replay ON warren_journal (replay_id) WHERE replay_id <> '';

CREATE INDEX warren_journal_message ON warren_journal (consumer_name, message_id);

CREATE INDEX warren_journal_at ON warren_journal (at);

-- Who changed what: every state-changing dead-letter command.
CREATE TABLE warren_audit (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    at       TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    operator TEXT    NOT NULL,
    os_user  TEXT    NOT NULL,
    action   TEXT    NOT NULL,
    target   TEXT    NOT NULL,
    detail   TEXT    NOT NULL,
    forced   INTEGER NOT NULL
);

CREATE INDEX warren_audit_at ON warren_audit (at);
