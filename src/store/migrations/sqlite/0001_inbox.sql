CREATE TABLE warren_inbox (
    consumer_name  TEXT NOT NULL,
    message_id     TEXT NOT NULL,
    event_type     TEXT NOT NULL,
    correlation_id TEXT NULL,
    received_at    TEXT NOT NULL,
    processed_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer_name, message_id)
);

CREATE INDEX warren_inbox_processed_at ON warren_inbox (consumer_name, processed_at);
