CREATE TABLE warren_outbox (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id   TEXT    NOT NULL UNIQUE,
    exchange     TEXT    NOT NULL,
    routing_key  TEXT    NOT NULL,
    properties   TEXT    NOT NULL,
    body         BLOB    NOT NULL,
    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT    NULL,
    published_at TEXT    NULL,
    failed_at    TEXT    NULL
);

CREATE INDEX warren_outbox_pending ON warren_outbox (id)
    WHERE published_at IS NULL AND failed_at IS NULL;

CREATE INDEX warren_outbox_published ON warren_outbox (published_at)
    WHERE published_at IS NOT NULL;
