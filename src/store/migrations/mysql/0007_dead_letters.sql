-- Dead letters kept in the service's database, one row per failure
-- (letter_id), grouped by what made them fail (group_key: the fingerprint
-- unless an operator moved the letter). Text columns, not VARBINARY: these are
-- read back as text, and found by, not keyed on, the message id.
CREATE TABLE warren_dead_letters (
    letter_id            VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    consumer_name        VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    queue_name           VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id           VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_type           VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    correlation_id       VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    replay_id            VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    reason               VARCHAR(64)    CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    error                TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    attempts             BIGINT         NOT NULL,
    original_exchange    VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    original_routing_key VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    first_failure        DATETIME(6)    NOT NULL,
    last_failure         DATETIME(6)    NOT NULL,
    fingerprint          VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    group_key            VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    headers              MEDIUMTEXT     CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    properties           MEDIUMTEXT     CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    body                 LONGBLOB       NOT NULL,
    body_truncated       BOOLEAN        NOT NULL,
    payload              JSON           NULL,
    redacted_fields      TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    entity               VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    entity_version       BIGINT         NULL,
    state                VARCHAR(16)    CHARACTER SET ascii NOT NULL,
    edited_body          LONGBLOB       NULL,
    edited_by            VARCHAR(255)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    edit_reason          TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    edited_at            DATETIME(6)    NULL,
    replay_count         BIGINT         NOT NULL DEFAULT 0,
    last_replay_id       VARCHAR(64)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT '',
    ingested_at          DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    state_changed_at     DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX warren_dead_letters_group (state, group_key, last_failure),
    INDEX warren_dead_letters_failed (last_failure),
    INDEX warren_dead_letters_message (message_id),
    INDEX warren_dead_letters_correlation (correlation_id),
    INDEX warren_dead_letters_type (event_type, last_failure)
) ENGINE = InnoDB;

-- Muted groups: not counted in the alerting metrics until muted_until, or
-- until the group holds more than count_at_mute + grow_limit letters.
CREATE TABLE warren_dead_letter_mutes (
    group_key     VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    muted_until   DATETIME(6)  NULL,
    grow_limit    BIGINT       NULL,
    count_at_mute BIGINT       NOT NULL,
    muted_by      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    reason        TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    muted_at      DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE = InnoDB;

-- A replay run: the letters of a group when it started (its warren_replays
-- rows, made at the start), replayed in seq order, resumable.
CREATE TABLE warren_replay_runs (
    run_id      VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    selection   TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    careful     BOOLEAN      NOT NULL,
    rate        DOUBLE       NULL,
    state       VARCHAR(16)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    stop_reason TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    total       BIGINT       NOT NULL,
    started_by  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    os_user     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    started_at  DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    updated_at  DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE = InnoDB;

-- One row per replay of a letter: made before it is published (published_at
-- NULL), so that a replay interrupted between the two publishes it again
-- under the same replay id.
CREATE TABLE warren_replays (
    replay_id     VARCHAR(100) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    letter_id     VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    run_id        VARCHAR(64)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    seq           BIGINT       NOT NULL,
    consumer_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    requested_by  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    os_user       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    edited        BOOLEAN      NOT NULL,
    created_at    DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    published_at  DATETIME(6)  NULL,
    INDEX warren_replays_run (run_id, seq),
    INDEX warren_replays_letter (letter_id)
) ENGINE = InnoDB;

-- The delivery journal: one row per outcome that has no business transaction
-- to ride on (duplicate, stale, retried, parked, dead-lettered, replayed),
-- and per applied outcome of a replayed copy, written in its transaction.
-- Applied outcomes otherwise are their inbox rows.
CREATE TABLE warren_journal (
    id            BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    replay_id     VARCHAR(100) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    outcome       VARCHAR(32)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    detail        TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    at            DATETIME(6)  NOT NULL,
    INDEX warren_journal_replay (replay_id),
    INDEX warren_journal_message (consumer_name, message_id),
    INDEX warren_journal_at (at)
) ENGINE = InnoDB;

-- Who changed what: every state-changing dead-letter command.
CREATE TABLE warren_audit (
    id       BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    at       DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    operator VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    os_user  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    action   VARCHAR(32)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    target   TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    detail   MEDIUMTEXT   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    forced   BOOLEAN      NOT NULL,
    INDEX warren_audit_at (at)
) ENGINE = InnoDB;
